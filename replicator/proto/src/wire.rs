//! Ferry's wire protocol, version 11: a sans-IO codec.
//!
//! Version 11 lets a source pool's agents open a striped transfer before
//! the sink has its row: an open whose [`Open::joins`] is set joins the
//! transfer its coordinator opens (at this sink agent or another of the
//! sink's pool). The sink never creates the transfer's row for it, and
//! never rewrites the row's file table or forgets its verified chunks:
//! it waits (5 s at most) for the coordinator's open to create the row,
//! and takes the open's table only where it agrees with the row's. So a
//! coordinator may announce its plan with its open, not one round trip
//! later. A source sets it only with a sink that speaks version 11; a
//! sink speaks versions 2 to 11.
//!
//! Version 10 lets a source send a part's chunks right behind its
//! registration, without waiting a round trip for the answer: an open
//! whose [`Open::parts_first`] is set tells the sink that every chunk
//! the sender sends of that transfer (until its commit) lies in a part
//! it registered first, and the sink holds a chunk that overtook its
//! part's registration (QUIC does not order one stream against another)
//! until the registration is recorded, then fences it as any other. A
//! source sets it only with a sink that speaks version 10; a sink speaks
//! versions 2 to 10.
//!
//! Version 9 adds the parts of a transfer striped across a source pool:
//! before sending a part it claimed, a source registers the part and its
//! claim's epoch ([`Control::Part`]); the sink answers the epoch its
//! catalog holds ([`Control::PartEpoch`]) and refuses the part's chunks
//! from a sender that registered an older one. A source registers
//! nothing with an older sink; a sink speaks versions 2 to 9.
//!
//! Version 8 adds weights-first publishes: an open may name
//! [`Profile::WeightsFirst`], and such a transfer's source sends a
//! weights-only commit ([`Commit::weights_only`]: the manifest of its
//! metadata and weight files) before the optimizer state and the full
//! commit; the sink publishes it as a weights-only version and answers
//! with [`Control::Published`] of its root. A source sends neither to a
//! sink older than version 8 (it opens such a transfer as `full`).
//!
//! Version 7 adds where the time went ([`crate::phases`]): a commit
//! carries the durations of the phases the source measured
//! ([`Commit::phases`]: the writer's last files, queued, sending), and
//! the published answer those the sink measured ([`Control::Published`]'s
//! `phases`: the last batches, verifying, publishing). A source sends
//! them only to a sink that speaks version 7, and a sink only to a
//! version 7 source; a sink speaks versions 2 to 7.
//!
//! Version 6 adds [`Control::Pin`]: a source asks the sink to pin the
//! replicas around an anomaly signal (the last checkpoint before the
//! signal's step and the first at or after it), so that its retention
//! policy keeps them for a while. A source sends it only to a sink that
//! speaks version 6; a sink speaks versions 2 to 6, and a source speaks
//! 6, or 5 or 4 to a sink that refuses 6 (as below).
//!
//! Version 5 added the source's catalog id to [`Control::Open`]
//! ([`TransferKey::origin`]): the sink keys a transfer's row by it (with
//! the source site and the transfer id) instead of by the agent that
//! sent it, so another agent of the source's pool, sharing its catalog,
//! continues a transfer where the first left off. A sink speaks versions
//! 2 to 5; a source speaks 5, or 4 to a sink that refuses 5 (it names the
//! versions it speaks, and the source dials again in the newest of them
//! it knows, [`MIN_SOURCE_VERSION`] at least).
//!
//! Version 4 lets a link's pool of connections lose one that does not
//! carry the control stream without stopping its transfers: each batch
//! header carries the batch's sequence number within its transfer
//! ([`BatchHeader::seq`]), the sink confirms each batch it has written and
//! verified ([`Control::BatchDone`]), and the commit lists the batches the
//! source gave up ([`Commit::lost`]: they went on a connection that was
//! lost before the sink confirmed them; their chunks were sent again in
//! later batches). A sink speaks versions 2 to 5 ([`MIN_PROTOCOL_VERSION`]
//! to [`PROTOCOL_VERSION`]) and answers a source's hello with the source's
//! version; it reads batch headers of the length that version gives
//! ([`BatchHeader::len_for`]) and confirms batches only to a version 4
//! source.
//!
//! Version 3 added [`Commit::checkpoint`] (the checkpoint's step and class
//! at commit, which the sink keeps with the replica for its retention
//! policy); a version 2 source sends no step or class.
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
use crate::phases::Phases;
use crate::state::{Profile, TransferId};

pub use crate::codec::WireError;

/// Protocol version carried in [`Hello`]: the one a source speaks, and the
/// newest a sink speaks. A sink refuses a version outside
/// [`MIN_PROTOCOL_VERSION`]..=[`PROTOCOL_VERSION`] with [`Control::Error`]
/// naming both; a source refuses a sink whose hello names another version.
pub const PROTOCOL_VERSION: u16 = 11;

/// The first protocol version whose opens may set [`Open::joins`]. Like
/// [`Open::parts_first`], the flag is written after the open's origin.
pub const JOIN_VERSION: u16 = 11;
const _: () = assert!(JOIN_VERSION >= ORIGIN_VERSION);

/// The first protocol version whose opens may set [`Open::parts_first`]:
/// the sender's chunks of the transfer may arrive before their part's
/// registration is answered, and the sink holds them until it is
/// recorded. The flag is written after the open's origin, so this is
/// never below [`ORIGIN_VERSION`] (checked when compiled), and an open
/// without an origin cannot set it.
pub const PARTS_FIRST_VERSION: u16 = 10;
const _: () = assert!(PARTS_FIRST_VERSION >= ORIGIN_VERSION);

/// The first protocol version whose sink takes [`Control::Part`]: a part
/// of a striped transfer registered under its claim's epoch.
pub const PARTS_VERSION: u16 = 9;

/// The first protocol version whose opens may name
/// [`Profile::WeightsFirst`] and whose commits may be
/// [`Commit::weights_only`].
pub const WEIGHTS_FIRST_VERSION: u16 = 8;

/// The first protocol version whose commits and published answers carry
/// phase durations ([`Commit::phases`]).
pub const PHASES_VERSION: u16 = 7;

/// The first protocol version whose sink takes [`Control::Pin`].
pub const PIN_VERSION: u16 = 6;

/// The oldest protocol version a source still speaks, to a sink that
/// refuses newer ones: its batches carry sequence numbers.
pub const MIN_SOURCE_VERSION: u16 = BATCH_SEQ_VERSION;

/// The first protocol version whose opens carry the source's catalog id
/// ([`TransferKey::origin`]).
pub const ORIGIN_VERSION: u16 = 5;

/// The oldest protocol version a sink still accepts from a source (its
/// commits carry no [`Commit::checkpoint`]).
pub const MIN_PROTOCOL_VERSION: u16 = 2;

/// The first protocol version whose batch headers carry a sequence number
/// ([`BatchHeader::seq`]), whose sink confirms batches
/// ([`Control::BatchDone`]) and whose commits list lost batches
/// ([`Commit::lost`]).
pub const BATCH_SEQ_VERSION: u16 = 4;

/// Magic bytes at the start of every data stream.
pub const DATA_MAGIC: [u8; 4] = *b"FRY1";

/// Size of a [`BatchHeader`] on the wire from a version 2 or 3 source
/// (magic, transfer id), in bytes.
pub const BATCH_HEADER_LEN: usize = 4 + 8;

/// Size of a [`BatchHeader`] on the wire from a version 4 source (magic,
/// transfer id, sequence number), in bytes.
pub const BATCH_HEADER_V4_LEN: usize = 4 + 8 + 8;

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
    /// The source catalog's id (from [`ORIGIN_VERSION`] on; `None` from
    /// an older source): with the source site and [`TransferKey::id`] the
    /// key of the transfer's row at the sink, whichever agent of the
    /// source's pool sends it. On the wire after the file table, only
    /// when present; at most 255 bytes.
    pub origin: Option<String>,
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
    /// From [`PARTS_FIRST_VERSION`]: the sender registers
    /// ([`Control::Part`]) the part of every chunk it sends of this
    /// transfer before the chunk, until its commit, and does not wait for
    /// the answer; the sink holds a chunk whose registration it has not
    /// recorded yet (10 s at most, then drops it: the commit asks for
    /// it again). On the wire a `u8` of flags (bit 0) after
    /// [`TransferKey::origin`], only when set, so only with an origin.
    pub parts_first: bool,
    /// From [`JOIN_VERSION`]: the sender is not the transfer's
    /// coordinator but another agent of its source pool, sending parts
    /// of it. The sink does not create the transfer's row for this open:
    /// it waits for the coordinator's open to create it (5 s at most,
    /// then refuses the open), keeps the row's verified chunks, and
    /// never writes the open's file table to the row; the open's table
    /// must agree with the row's (one a prefix of the other, file by
    /// file), or the open is refused naming the first file that differs.
    /// On the wire bit 1 of the flags byte (see [`Open::parts_first`]).
    pub joins: bool,
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
    /// Number of data streams (batches) the source sent for this transfer
    /// since this run's open, on any connection of the link's pool, so the
    /// sink knows when all of them have arrived. From a version 4 source
    /// their sequence numbers are `0..batches`, and the sink waits for
    /// each of them except those in [`Commit::lost`].
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
    /// Version 4: sequence numbers ([`BatchHeader::seq`]) of batches the
    /// source gave up: they went on a connection of the pool that was lost
    /// before the sink confirmed them ([`Control::BatchDone`]), and their
    /// chunks were sent again in later batches. The sink does not wait
    /// for them, and ignores them if they arrive after the commit. Empty
    /// from a version 2 or 3 source.
    ///
    /// Encoded after the checkpoint info (flag bit 1, then a `u32` count
    /// and a `u64` each, at most [`crate::limits::MAX_CHUNKS`]); an empty
    /// list is encoded as nothing, so a version 4 commit with no lost
    /// batch is byte for byte a version 3 one. A commit with lost batches
    /// but no checkpoint info (which no source sends: version 4 always
    /// sends both) is encoded with an empty checkpoint info, and decodes
    /// with `Some(CheckpointInfo::default())`.
    pub lost: Vec<u64>,
    /// Version 7: how long the checkpoint spent in each phase at the
    /// source so far (before the commit, and after it until this commit
    /// message went). Encoded after the lost batches under flag bit 2
    /// ([`Phases`]' encoding); empty is encoded as nothing, and a source
    /// sends none to a sink older than [`PHASES_VERSION`].
    pub phases: Phases,
    /// Version 8: this commit names the weights-only part of a
    /// [`Profile::WeightsFirst`] transfer (its manifest lists the metadata
    /// and weight files, not the optimizer state): the sink publishes it
    /// as a `weights-only` version as soon as its chunks are verified and
    /// answers with [`Control::Published`] of its root; the full commit
    /// follows. Flag bit 4, no payload; a source sends none to an older
    /// sink.
    pub weights_only: bool,
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
    /// Version 7: how many readers (eval ranks starting at once) the
    /// training controller expects for its replica (the announcement's
    /// `readers`), for an HDFS sink's hot-file replication hints; encoded
    /// under flag bit 3 after the phases, a `u64` of at least 1. `None`:
    /// not given (the sink's configured `readers` applies).
    pub readers: Option<u64>,
}

/// Which replica of a job a [`PinRequest`] pins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PinTarget {
    /// The newest replica of the job from this source (a signal without a
    /// step); if there is none yet, the next one published.
    Newest,
    /// The replica of this training step, now or once it is published.
    Step(u64),
    /// The replica with the smallest step at or above this one: the one
    /// present now, else the first published later.
    AtOrAfter(u64),
}

/// [`Control::Pin`]: source to sink (version 6), pin a replica of `job`
/// from this source's site for `for_ms` because of a signal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinRequest {
    /// The job (at most 255 bytes).
    pub job: String,
    /// Which replica.
    pub target: PinTarget,
    /// Why, shown with the pin (the signal, and which checkpoint this is
    /// to it); at most 65,535 bytes.
    pub reason: String,
    /// How long the pin lasts from when the sink receives the request,
    /// milliseconds; a replica published later is pinned only while the
    /// request lasts.
    pub for_ms: u64,
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
        /// Path of the replica at the sink, or its URL on an HDFS or S3
        /// sink (`hdfs://eval-nn:8020/eval/site/job/step-100`).
        local_path: String,
        /// BLAKE3 root of the published manifest.
        root: Hash,
        /// Version 7: the phases the sink measured for this publish (the
        /// last batches after the commit arrived, verifying, publishing),
        /// appended after the root when not empty; a sink sends none to a
        /// source older than [`PHASES_VERSION`].
        phases: Phases,
    },
    /// Either direction: stop this transfer and discard its staging data.
    Cancel {
        /// Source transfer id.
        id: TransferId,
        /// Why.
        reason: String,
    },
    /// Sink to a version 4 source, on the control stream the transfer was
    /// opened on: these batches of the transfer (sequence numbers,
    /// [`BatchHeader::seq`]) arrived whole and every chunk in them was
    /// written and verified (or was already; a chunk that failed
    /// verification is asked for with [`Control::Need`]). Batches that
    /// finish together share one message. The source stops keeping their
    /// chunks for re-sending elsewhere.
    BatchDone {
        /// Source transfer id.
        id: TransferId,
        /// Sequence numbers, at most [`crate::limits::MAX_CHUNKS`].
        seqs: Vec<u64>,
    },
    /// Source to a version 6 sink: pin a replica because of a signal
    /// (no answer).
    Pin(PinRequest),
    /// Source to a version 9 sink, before any chunk of a part of a
    /// striped transfer it opened: it claimed part `part` (chunk keys
    /// `first_key` to `end_key`, excluded) under `epoch`. The sink records
    /// the epoch in its catalog, unless a later one is recorded, and
    /// answers [`Control::PartEpoch`]; from then on every sink agent of
    /// the site refuses the part's chunks from a sender that registered an
    /// older epoch.
    Part {
        /// Source transfer id.
        id: TransferId,
        /// The part's number in the transfer's plan.
        part: u64,
        /// The claim's epoch (from 1).
        epoch: u64,
        /// The part's first chunk key.
        first_key: u64,
        /// One more than its last chunk key.
        end_key: u64,
    },
    /// Sink to source, answering [`Control::Part`]: the epoch the sink's
    /// catalog holds for the part now. Another than the one registered
    /// means the part was claimed again since: the sender stops sending
    /// it.
    PartEpoch {
        /// Source transfer id.
        id: TransferId,
        /// The part.
        part: u64,
        /// The epoch recorded.
        epoch: u64,
    },
    /// Either direction: a fatal protocol error; the connection closes.
    Error {
        /// Human-readable message.
        message: String,
    },
}

const T_HELLO: u8 = 1;
const T_OPEN: u8 = 2;
/// [`Open::parts_first`]'s bit in an open's flags.
const OPEN_PARTS_FIRST: u8 = 1;
/// [`Open::joins`]'s bit in an open's flags.
const OPEN_JOINS: u8 = 2;
const T_HAVE: u8 = 3;
const T_REFUSE: u8 = 4;
const T_NEED: u8 = 5;
const T_COMMIT: u8 = 6;
const T_PUBLISHED: u8 = 7;
const T_CANCEL: u8 = 8;
const T_ERROR: u8 = 9;
const T_FILES: u8 = 10;
const T_BATCH_DONE: u8 = 11;
const T_PIN: u8 = 12;
const T_PART: u8 = 13;
const T_PART_EPOCH: u8 = 14;

/// [`PinTarget`] kinds on the wire.
const PIN_NEWEST: u8 = 0;
const PIN_STEP: u8 = 1;
const PIN_AT_OR_AFTER: u8 = 2;

/// Flag bits of the checkpoint info of a commit (version 3 and later).
const CK_STEP: u8 = 1;
/// A list of lost batches follows the class (version 4).
const CK_LOST: u8 = 2;
/// Phase durations follow the lost batches (version 7).
const CK_PHASES: u8 = 4;
/// The expected readers follow the phases (version 7).
const CK_READERS: u8 = 8;
/// Commit flag bit 4 (version 8): [`Commit::weights_only`].
const CK_WEIGHTS_ONLY: u8 = 16;

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
            Control::BatchDone { .. } => "batch-done",
            Control::Pin(_) => "pin",
            Control::Part { .. } => "part",
            Control::PartEpoch { .. } => "part-epoch",
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
                parts_first,
                joins,
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
                if let Some(origin) = &key.origin {
                    w.str(origin);
                    let flags = if *parts_first { OPEN_PARTS_FIRST } else { 0 }
                        | if *joins { OPEN_JOINS } else { 0 };
                    if flags != 0 {
                        w.u8(flags);
                    }
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
                lost,
                phases,
                weights_only,
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
                if checkpoint.is_some() || !lost.is_empty() || !phases.is_empty() || *weights_only {
                    // Version 7 with readers: flag bit 3, then a u64.
                    // Version 3: a flag byte (bit 0: step present), the
                    // step (0 when absent), the class name; version 4
                    // with lost batches: flag bit 1, then their list;
                    // version 7 with phases: flag bit 2, then them.
                    let empty = CheckpointInfo::default();
                    let c = checkpoint.as_ref().unwrap_or(&empty);
                    let mut flags = 0;
                    if c.step.is_some() {
                        flags |= CK_STEP;
                    }
                    if !lost.is_empty() {
                        flags |= CK_LOST;
                    }
                    if !phases.is_empty() {
                        flags |= CK_PHASES;
                    }
                    if c.readers.is_some() {
                        flags |= CK_READERS;
                    }
                    if *weights_only {
                        flags |= CK_WEIGHTS_ONLY;
                    }
                    w.u8(flags);
                    w.u64(c.step.unwrap_or(0));
                    w.str(&c.class);
                    if !lost.is_empty() {
                        w.indices(lost);
                    }
                    if !phases.is_empty() {
                        phases.encode(&mut w);
                    }
                    if let Some(n) = c.readers {
                        w.u64(n);
                    }
                }
            }
            Control::Published {
                id,
                local_path,
                root,
                phases,
            } => {
                w.u8(T_PUBLISHED);
                w.u64(id.0);
                w.long_str(local_path);
                w.0.extend_from_slice(root);
                if !phases.is_empty() {
                    phases.encode(&mut w);
                }
            }
            Control::Cancel { id, reason } => {
                w.u8(T_CANCEL);
                w.u64(id.0);
                w.long_str(reason);
            }
            Control::BatchDone { id, seqs } => {
                w.u8(T_BATCH_DONE);
                w.u64(id.0);
                w.indices(seqs);
            }
            Control::Part {
                id,
                part,
                epoch,
                first_key,
                end_key,
            } => {
                w.u8(T_PART);
                w.u64(id.0);
                w.u64(*part);
                w.u64(*epoch);
                w.u64(*first_key);
                w.u64(*end_key);
            }
            Control::PartEpoch { id, part, epoch } => {
                w.u8(T_PART_EPOCH);
                w.u64(id.0);
                w.u64(*part);
                w.u64(*epoch);
            }
            Control::Pin(p) => {
                w.u8(T_PIN);
                w.str(&p.job);
                let (kind, step) = match p.target {
                    PinTarget::Newest => (PIN_NEWEST, 0),
                    PinTarget::Step(s) => (PIN_STEP, s),
                    PinTarget::AtOrAfter(s) => (PIN_AT_OR_AFTER, s),
                };
                w.u8(kind);
                w.u64(step);
                w.long_str(&p.reason);
                w.u64(p.for_ms);
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
                    origin: None,
                };
                let chunk_size = r.u32("chunk size")?;
                let bytes_total = r.u64("bytes total")?;
                let n = r.count("file count", MAX_FILES, FileInfo::MIN_ENCODED)?;
                let mut files = Vec::with_capacity(n);
                for _ in 0..n {
                    files.push(FileInfo::decode(&mut r)?);
                }
                // Version 5 appends the source's catalog id.
                let mut key = key;
                if r.remaining() > 0 {
                    let origin = r.str("origin")?;
                    if origin.is_empty() || origin.len() > 255 {
                        return Err(WireError::Invalid {
                            what: "origin",
                            why: format!("a catalog id of {} bytes (1 to 255)", origin.len()),
                        });
                    }
                    key.origin = Some(origin);
                }
                // Version 10 appends flags after the origin.
                let mut flags = 0;
                if key.origin.is_some() && r.remaining() > 0 {
                    flags = r.u8("open flags")?;
                    if flags & !(OPEN_PARTS_FIRST | OPEN_JOINS) != 0 {
                        return Err(WireError::Invalid {
                            what: "open flags",
                            why: format!("unknown bits in {flags:#04x}"),
                        });
                    }
                }
                Control::Open(Open {
                    key,
                    chunk_size,
                    bytes_total,
                    files,
                    parts_first: flags & OPEN_PARTS_FIRST != 0,
                    joins: flags & OPEN_JOINS != 0,
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
                // Version 3 appends the checkpoint's step and class (and
                // version 4 its lost batches); a version 2 commit ends here.
                let (checkpoint, lost, phases, weights_only) = if r.remaining() == 0 {
                    (None, Vec::new(), Phases::default(), false)
                } else {
                    let flags = r.u8("checkpoint flags")?;
                    if flags & !(CK_STEP | CK_LOST | CK_PHASES | CK_READERS | CK_WEIGHTS_ONLY) != 0
                    {
                        return Err(WireError::Invalid {
                            what: "checkpoint flags",
                            why: format!("unknown bits in {flags:#04x}"),
                        });
                    }
                    let step = r.u64("step")?;
                    if flags & CK_STEP == 0 && step != 0 {
                        // Encoded as 0 when absent: anything else would
                        // not encode back to the same bytes.
                        return Err(WireError::Invalid {
                            what: "step",
                            why: format!("{step} without the step flag"),
                        });
                    }
                    let class = r.str("class")?;
                    if class.len() > 255 {
                        return Err(WireError::TooLarge {
                            what: "class name",
                            got: class.len() as u64,
                            limit: 255,
                        });
                    }
                    let lost = if flags & CK_LOST != 0 {
                        let lost = r.indices_named("lost batch count", "lost batch")?;
                        if lost.is_empty() {
                            return Err(WireError::Invalid {
                                what: "lost batches",
                                why: "flagged but the list is empty".into(),
                            });
                        }
                        lost
                    } else {
                        Vec::new()
                    };
                    let phases = if flags & CK_PHASES != 0 {
                        Phases::decode(&mut r)?
                    } else {
                        Phases::default()
                    };
                    let readers = if flags & CK_READERS != 0 {
                        let n = r.u64("readers")?;
                        if n == 0 {
                            return Err(WireError::Invalid {
                                what: "readers",
                                why: "flagged but 0".into(),
                            });
                        }
                        Some(n)
                    } else {
                        None
                    };
                    let info = CheckpointInfo {
                        step: (flags & CK_STEP != 0).then_some(step),
                        class,
                        readers,
                    };
                    (Some(info), lost, phases, flags & CK_WEIGHTS_ONLY != 0)
                };
                Control::Commit(Commit {
                    id,
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
            T_PUBLISHED => Control::Published {
                id: TransferId(r.u64("transfer id")?),
                local_path: r.long_str("local path")?,
                root: r.hash("manifest root")?,
                phases: if r.remaining() > 0 {
                    Phases::decode(&mut r)?
                } else {
                    Phases::default()
                },
            },
            T_CANCEL => Control::Cancel {
                id: TransferId(r.u64("transfer id")?),
                reason: r.long_str("reason")?,
            },
            T_BATCH_DONE => Control::BatchDone {
                id: TransferId(r.u64("transfer id")?),
                seqs: r.indices_named("batch count", "batch sequence number")?,
            },
            T_PART => {
                let m = Control::Part {
                    id: TransferId(r.u64("transfer id")?),
                    part: r.u64("part")?,
                    epoch: r.u64("epoch")?,
                    first_key: r.u64("first chunk key")?,
                    end_key: r.u64("end chunk key")?,
                };
                if let Control::Part {
                    first_key, end_key, ..
                } = m
                {
                    if first_key >= end_key {
                        return Err(WireError::Invalid {
                            what: "part",
                            why: format!("chunk keys {first_key} to {end_key} are empty"),
                        });
                    }
                }
                m
            }
            T_PART_EPOCH => Control::PartEpoch {
                id: TransferId(r.u64("transfer id")?),
                part: r.u64("part")?,
                epoch: r.u64("epoch")?,
            },
            T_PIN => {
                let job = r.str("job")?;
                let kind = r.u8("pin target")?;
                let step = r.u64("step")?;
                let target = match kind {
                    // One encoding per message: the newest has no step.
                    PIN_NEWEST if step != 0 => {
                        return Err(WireError::Invalid {
                            what: "pin target",
                            why: format!("the newest replica with a step ({step})"),
                        })
                    }
                    PIN_NEWEST => PinTarget::Newest,
                    PIN_STEP => PinTarget::Step(step),
                    PIN_AT_OR_AFTER => PinTarget::AtOrAfter(step),
                    k => {
                        return Err(WireError::Invalid {
                            what: "pin target",
                            why: format!("unknown kind {k} (0, 1 or 2)"),
                        })
                    }
                };
                Control::Pin(PinRequest {
                    job,
                    target,
                    reason: r.long_str("pin reason")?,
                    for_ms: r.u64("pin duration")?,
                })
            }
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

/// Header at the start of every data stream: the magic bytes
/// [`DATA_MAGIC`], the transfer id (`u64`) and, from a version 4 source,
/// the batch's sequence number (`u64`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchHeader {
    /// Source transfer id the records belong to.
    pub transfer: TransferId,
    /// Version 4: the batch's sequence number within its transfer's run,
    /// assigned by the source from 0 in the order the batches are opened
    /// (on any connection of the pool); the sink confirms it with
    /// [`Control::BatchDone`]. `None` from a version 2 or 3 source.
    pub seq: Option<u64>,
}

impl BatchHeader {
    /// The header's length on the wire from a source speaking `version`:
    /// [`BATCH_HEADER_V4_LEN`] from [`BATCH_SEQ_VERSION`] on, else
    /// [`BATCH_HEADER_LEN`].
    pub fn len_for(version: u16) -> usize {
        if version >= BATCH_SEQ_VERSION {
            BATCH_HEADER_V4_LEN
        } else {
            BATCH_HEADER_LEN
        }
    }

    /// Encodes the header: [`BATCH_HEADER_V4_LEN`] bytes with a sequence
    /// number, [`BATCH_HEADER_LEN`] without.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(BATCH_HEADER_V4_LEN);
        b.extend_from_slice(&DATA_MAGIC);
        b.extend_from_slice(&self.transfer.0.to_be_bytes());
        if let Some(seq) = self.seq {
            b.extend_from_slice(&seq.to_be_bytes());
        }
        b
    }

    /// Decodes a header of [`BATCH_HEADER_LEN`] bytes (no sequence number)
    /// or [`BATCH_HEADER_V4_LEN`] bytes (with one).
    ///
    /// # Errors
    /// [`WireError::BadMagic`] when the magic bytes are wrong;
    /// [`WireError::Invalid`] for any other length.
    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        if b.len() != BATCH_HEADER_LEN && b.len() != BATCH_HEADER_V4_LEN {
            return Err(WireError::Invalid {
                what: "batch header length",
                why: format!(
                    "{} bytes, expected {BATCH_HEADER_LEN} or {BATCH_HEADER_V4_LEN}",
                    b.len()
                ),
            });
        }
        if b[..4] != DATA_MAGIC {
            return Err(WireError::BadMagic);
        }
        let mut r = Reader::new(&b[4..]);
        let transfer = TransferId(r.u64("transfer id")?);
        let seq = if r.remaining() > 0 {
            Some(r.u64("batch sequence number")?)
        } else {
            None
        };
        Ok(BatchHeader { transfer, seq })
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
    use std::time::Duration;

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

    /// A version 5 open carries the source catalog's id after the file
    /// table; an older one none; an empty or oversized id is refused,
    /// naming the field.
    #[test]
    fn an_open_carries_its_origin_and_a_bad_one_is_refused() {
        let open = |origin: Option<String>| open_with(origin, false, false);
        roundtrip(open(Some("00112233445566778899aabbccddeeff".into())));
        roundtrip(open(None));
        for bad in [String::new(), "x".repeat(256)] {
            let mut frame = open(None).encode();
            frame.extend_from_slice(&(bad.len() as u16).to_be_bytes());
            frame.extend_from_slice(bad.as_bytes());
            let e = Control::decode(&frame[4..]).unwrap_err().to_string();
            assert!(e.contains("origin"), "{e}");
        }
    }

    /// A version 10 open's flags follow its origin: `parts_first` and
    /// (version 11) `joins` come back as sent, alone or together, an
    /// older open (no flags byte) reads as both unset, and an unknown bit
    /// is refused, naming the field.
    #[test]
    fn an_open_carries_its_flags_after_its_origin() {
        let origin = || Some("00112233445566778899aabbccddeeff".to_string());
        for (parts_first, joins) in [(true, false), (false, true), (true, true)] {
            let o = open_with(origin(), parts_first, joins);
            roundtrip(o.clone());
            match Control::decode(&o.encode()[4..]).unwrap() {
                Control::Open(d) => assert_eq!((d.parts_first, d.joins), (parts_first, joins)),
                m => panic!("decoded {m:?}"),
            }
        }
        let old = open_with(origin(), false, false).encode();
        let new = open_with(origin(), true, true).encode();
        assert_eq!(new.len(), old.len() + 1, "one flags byte, only when set");
        match Control::decode(&old[4..]).unwrap() {
            Control::Open(o) => assert!(!o.parts_first && !o.joins),
            m => panic!("decoded {m:?}"),
        }
        let mut bad = open_with(origin(), false, false).encode();
        bad.push(0x84);
        let e = Control::decode(&bad[4..]).unwrap_err().to_string();
        assert!(e.contains("open flags"), "{e}");
        // Without an origin there is nowhere to put the flags: not sent.
        assert_eq!(
            open_with(None, true, true).encode().len(),
            open_with(None, false, false).encode().len()
        );
    }

    fn open_with(origin: Option<String>, parts_first: bool, joins: bool) -> Control {
        Control::Open(Open {
            key: TransferKey {
                id: TransferId(7),
                job: "mm".into(),
                source_path: "/ckpt/mm/step_1".into(),
                rel: "step_1".into(),
                profile: Profile::Full,
                origin,
            },
            chunk_size: 4 << 20,
            bytes_total: 0,
            files: vec![],
            parts_first,
            joins,
        })
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
                origin: None,
            },
            chunk_size: 4 << 20,
            bytes_total: 10,
            files: vec![FileInfo {
                path: "x".into(),
                size: 10,
                mode: 0o600,
                mtime_ns: -5,
            }],
            parts_first: false,
            joins: false,
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
                readers: None,
            }),
            lost: vec![],
            phases: Phases::default(),
            weights_only: false,
        }));
        // Version 4 with lost batches.
        roundtrip(Control::Commit(Commit {
            id: TransferId(3),
            committed_ms: 1,
            opened_ms: 2,
            batches: 12,
            manifest: manifest(),
            siblings: vec![],
            checkpoint: Some(CheckpointInfo {
                step: None,
                class: "scheduled".into(),
                readers: None,
            }),
            lost: vec![4, 9, 10],
            phases: Phases::default(),
            weights_only: false,
        }));
        // Version 2 (no checkpoint info), and version 3 without a step.
        for checkpoint in [
            None,
            Some(CheckpointInfo {
                step: None,
                class: String::new(),
                readers: None,
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
                lost: vec![],
                phases: Phases::default(),
                weights_only: false,
            }));
        }
        roundtrip(Control::Published {
            id: TransferId(3),
            local_path: "/eval/x".into(),
            root: [9; 32],
            phases: Phases::default(),
        });
        roundtrip(Control::Cancel {
            id: TransferId(3),
            reason: "deleted".into(),
        });
        roundtrip(Control::BatchDone {
            id: TransferId(3),
            seqs: vec![0, 7],
        });
        roundtrip(Control::Part {
            id: TransferId(3),
            part: 17,
            epoch: 2,
            first_key: 1 << 32,
            end_key: (1 << 32) + 64,
        });
        roundtrip(Control::PartEpoch {
            id: TransferId(3),
            part: 17,
            epoch: 3,
        });
        let mut empty = Control::Part {
            id: TransferId(3),
            part: 1,
            epoch: 1,
            first_key: 9,
            end_key: 9,
        }
        .encode();
        let e = Control::decode(&empty.split_off(4)).unwrap_err();
        assert!(e.to_string().contains("empty"), "{e}");
        for target in [
            PinTarget::Newest,
            PinTarget::Step(1200),
            PinTarget::AtOrAfter(u64::MAX),
        ] {
            roundtrip(Control::Pin(PinRequest {
                job: "mm-large".into(),
                target,
                reason: "loss_spike at step 1200".into(),
                for_ms: 7 * 86_400_000,
            }));
        }
        roundtrip(Control::Error {
            message: "bad".into(),
        });
    }

    #[test]
    fn a_pin_of_an_unknown_target_kind_is_named() {
        let mut b = Control::Pin(PinRequest {
            job: "j".into(),
            target: PinTarget::Step(3),
            reason: String::new(),
            for_ms: 1,
        })
        .encode();
        // Frame length (4), type (1), job (2 + 1): the target kind.
        b[8] = 9;
        let e = Control::decode(&b[4..]).unwrap_err();
        assert!(e.to_string().contains("pin target"), "{e}");
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
                readers: None,
            }),
            lost: vec![],
            phases: Phases::default(),
            weights_only: false,
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
                origin: None,
            },
            chunk_size: 1 << 20,
            bytes_total: 0,
            files: vec![],
            parts_first: false,
            joins: false,
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
            seq: None,
        }
        .encode();
        bad[0] = b'X';
        assert_eq!(BatchHeader::decode(&bad), Err(WireError::BadMagic));
    }

    /// Bytes of a version 3 commit as a version 3 source wrote them
    /// (before version 4 existed): type, id 5, commit time 1, open time 2,
    /// 3 batches, the test manifest, no siblings, step 7, class "urgent".
    fn v3_commit_bytes() -> Vec<u8> {
        let mut b = vec![T_COMMIT];
        for v in [5u64, 1, 2, 3] {
            b.extend_from_slice(&v.to_be_bytes());
        }
        b.extend_from_slice(&manifest().encode());
        b.extend_from_slice(&0u32.to_be_bytes());
        b.push(1);
        b.extend_from_slice(&7u64.to_be_bytes());
        b.extend_from_slice(&6u16.to_be_bytes());
        b.extend_from_slice(b"urgent");
        b
    }

    #[test]
    fn a_version_3_commit_decodes_unchanged_with_no_lost_batches() {
        let v3 = v3_commit_bytes();
        let want = Commit {
            id: TransferId(5),
            committed_ms: 1,
            opened_ms: 2,
            batches: 3,
            manifest: manifest(),
            siblings: vec![],
            checkpoint: Some(CheckpointInfo {
                step: Some(7),
                class: "urgent".into(),
                readers: None,
            }),
            lost: vec![],
            phases: Phases::default(),
            weights_only: false,
        };
        assert_eq!(Control::decode(&v3).unwrap(), Control::Commit(want.clone()));
        // A version 4 commit that lost nothing is the same bytes.
        assert_eq!(&Control::Commit(want.clone()).encode()[4..], &v3[..]);
        // With lost batches: flag bit 1 and the list after the class.
        let v4 = Control::Commit(Commit {
            lost: vec![2],
            phases: Phases::default(),
            ..want
        })
        .encode();
        let body = &v4[4..];
        let mut expect = v3.clone();
        let flags_at = v3.len() - (1 + 8 + 2 + 6);
        expect[flags_at] = 1 | 2;
        expect.extend_from_slice(&1u32.to_be_bytes());
        expect.extend_from_slice(&2u64.to_be_bytes());
        assert_eq!(body, &expect[..]);
    }

    #[test]
    fn lost_batches_flagged_but_empty_or_cut_short_are_errors() {
        let mut b = v3_commit_bytes();
        let flags_at = b.len() - (1 + 8 + 2 + 6);
        b[flags_at] = 1 | 2;
        // Flagged, no list at all.
        assert!(matches!(
            Control::decode(&b),
            Err(WireError::Truncated { .. })
        ));
        // Flagged, an empty list (not canonical: it encodes as no flag).
        let mut empty = b.clone();
        empty.extend_from_slice(&0u32.to_be_bytes());
        match Control::decode(&empty) {
            Err(WireError::Invalid { what, .. }) => assert_eq!(what, "lost batches"),
            other => panic!("{other:?}"),
        }
        // A count larger than what follows.
        let mut cut = b.clone();
        cut.extend_from_slice(&2u32.to_be_bytes());
        cut.extend_from_slice(&1u64.to_be_bytes());
        assert!(matches!(
            Control::decode(&cut),
            Err(WireError::Truncated { .. })
        ));
        // Unknown flag bits are still named.
        b[flags_at] = 32;
        match Control::decode(&b) {
            Err(WireError::Invalid { what, .. }) => assert_eq!(what, "checkpoint flags"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn version_8_weights_only_commits_and_weights_first_opens_round_trip() {
        let commit = Commit {
            id: TransferId(11),
            committed_ms: 1_700_000_000_000,
            opened_ms: 0,
            batches: 2,
            manifest: manifest(),
            siblings: vec![],
            checkpoint: Some(CheckpointInfo {
                step: Some(100),
                class: "urgent".into(),
                readers: None,
            }),
            lost: vec![],
            phases: Phases::default(),
            weights_only: true,
        };
        roundtrip(Control::Commit(commit.clone()));
        let flagged = Control::Commit(commit.clone()).encode();
        let full = Control::Commit(Commit {
            weights_only: false,
            ..commit
        })
        .encode();
        // One flag bit apart, nothing else: a full commit is unchanged.
        assert_eq!(flagged.len(), full.len());
        let diff: Vec<usize> = (0..full.len())
            .filter(|i| flagged[*i] != full[*i])
            .collect();
        assert_eq!(diff.len(), 1, "{diff:?}");
        assert_eq!(flagged[diff[0]] ^ full[diff[0]], CK_WEIGHTS_ONLY);
        // An unknown flag bit is still refused.
        let mut bad = flagged.clone();
        bad[diff[0]] |= 32;
        assert!(Control::decode(&bad[4..]).is_err());
        roundtrip(Control::Open(Open {
            key: TransferKey {
                id: TransferId(11),
                job: "j".into(),
                source_path: "/ckpt/j/global_step100".into(),
                rel: "global_step100".into(),
                profile: Profile::WeightsFirst,
                origin: Some("c1".into()),
            },
            chunk_size: 1 << 20,
            bytes_total: 0,
            files: vec![],
            parts_first: false,
            joins: false,
        }));
    }

    #[test]
    fn version_7_phases_travel_with_the_commit_and_the_published_answer() {
        use crate::phases::Phase;
        let mut phases = Phases::default();
        phases.add(false, Phase::Streaming, Duration::from_millis(42_000));
        phases.add(true, Phase::Writer, Duration::from_micros(1_500_250));
        phases.add(true, Phase::Sending, Duration::from_secs(3));
        let commit = Commit {
            id: TransferId(9),
            committed_ms: 1_700_000_000_000,
            opened_ms: 1_699_999_990_000,
            batches: 4,
            manifest: manifest(),
            siblings: vec![],
            checkpoint: None,
            lost: vec![],
            phases: phases.clone(),
            weights_only: false,
        };
        // Phases without checkpoint info travel with an empty one.
        let frame = Control::Commit(commit.clone()).encode();
        match Control::decode(&frame[4..]).unwrap() {
            Control::Commit(c) => {
                assert_eq!(c.phases, phases);
                assert_eq!(c.checkpoint, Some(CheckpointInfo::default()));
                assert!(c.lost.is_empty());
            }
            other => panic!("{other:?}"),
        }
        roundtrip(Control::Commit(Commit {
            checkpoint: Some(CheckpointInfo {
                step: Some(7),
                class: "urgent".into(),
                readers: None,
            }),
            lost: vec![3],
            ..commit.clone()
        }));
        // The expected readers, with and without phases.
        for phases in [phases.clone(), Phases::default()] {
            roundtrip(Control::Commit(Commit {
                checkpoint: Some(CheckpointInfo {
                    step: None,
                    class: "scheduled".into(),
                    readers: Some(20_000),
                }),
                phases,
                ..commit.clone()
            }));
        }
        // Without phases a commit is byte for byte a version 6 one.
        let v6 = Control::Commit(Commit {
            phases: Phases::default(),
            ..commit.clone()
        })
        .encode();
        assert!(v6.len() < frame.len());
        let published = Control::Published {
            id: TransferId(9),
            local_path: "/eval/x".into(),
            root: [1; 32],
            phases: phases.clone(),
        };
        roundtrip(published.clone());
        let bare = Control::Published {
            id: TransferId(9),
            local_path: "/eval/x".into(),
            root: [1; 32],
            phases: Phases::default(),
        }
        .encode();
        assert_eq!(bare.len(), 4 + 1 + 8 + 4 + 7 + 32, "a version 6 published");
        // An unknown phase code, a phase twice, and too many are named.
        let good = published.encode();
        let at = 4 + 1 + 8 + 4 + 7 + 32;
        let mut bad = good.clone();
        bad[at + 1] = 9;
        match Control::decode(&bad[4..]) {
            Err(WireError::Invalid { what, .. }) => assert_eq!(what, "phase"),
            other => panic!("{other:?}"),
        }
        // Before: count, code, µs; after: count, then the waiting for
        // the writer's code at +11 and sending's at +20.
        let mut twice = good.clone();
        twice[at + 20] = twice[at + 11];
        match Control::decode(&twice[4..]) {
            Err(WireError::Invalid { what, why }) => {
                assert_eq!(what, "phase");
                assert!(
                    why.contains("waiting_for_writer listed twice or out of order"),
                    "{why}"
                );
            }
            other => panic!("{other:?}"),
        }
        let mut many = good.clone();
        many[at] = 200;
        assert!(matches!(
            Control::decode(&many[4..]),
            Err(WireError::TooLarge {
                what: "phase count",
                ..
            })
        ));
    }

    #[test]
    fn lost_batches_without_checkpoint_info_travel_with_an_empty_one() {
        let frame = Control::Commit(Commit {
            id: TransferId(1),
            committed_ms: 0,
            opened_ms: 0,
            batches: 2,
            manifest: manifest(),
            siblings: vec![],
            checkpoint: None,
            lost: vec![1],
            phases: Phases::default(),
            weights_only: false,
        })
        .encode();
        match Control::decode(&frame[4..]).unwrap() {
            Control::Commit(c) => {
                assert_eq!(c.checkpoint, Some(CheckpointInfo::default()));
                assert_eq!(c.lost, vec![1]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn batch_headers_carry_a_sequence_number_from_version_4() {
        assert_eq!(BatchHeader::len_for(2), BATCH_HEADER_LEN);
        assert_eq!(BatchHeader::len_for(3), BATCH_HEADER_LEN);
        assert_eq!(BatchHeader::len_for(4), BATCH_HEADER_V4_LEN);
        let v3 = BatchHeader {
            transfer: TransferId(9),
            seq: None,
        };
        let b = v3.encode();
        // Version 3's bytes: the magic and the id, nothing else.
        let mut want = DATA_MAGIC.to_vec();
        want.extend_from_slice(&9u64.to_be_bytes());
        assert_eq!(b, want);
        assert_eq!(BatchHeader::decode(&b), Ok(v3));
        let v4 = BatchHeader {
            transfer: TransferId(9),
            seq: Some(41),
        };
        let b = v4.encode();
        assert_eq!(b.len(), BATCH_HEADER_V4_LEN);
        assert_eq!(&b[BATCH_HEADER_LEN..], &41u64.to_be_bytes());
        assert_eq!(BatchHeader::decode(&b), Ok(v4));
        for len in [0, 4, 11, 13, 19, 21] {
            assert!(
                matches!(
                    BatchHeader::decode(&vec![0; len]),
                    Err(WireError::Invalid { .. })
                ),
                "{len} bytes"
            );
        }
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
