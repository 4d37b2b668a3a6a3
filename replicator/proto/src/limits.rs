//! The protocol limits: every length or count read from a peer is bounded
//! by one of these before anything is allocated.

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
