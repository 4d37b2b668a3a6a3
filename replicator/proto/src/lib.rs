//! Ferry's protocol without I/O: the wire codec, manifest types and their
//! canonical encoding, chunk maths and chunk keys, checks of paths and
//! names received from a peer, the protocol limits and the units parsed
//! from config files and the command line.
//!
//! Nothing here touches a socket, a file or a clock: callers hand in bytes
//! and get messages or errors back (see ARCHITECTURE.md, "Crates"). The
//! crate depends on no async runtime, QUIC stack, database or file watcher.

mod codec;
pub mod limits;
pub mod manifest;
pub mod paths;
pub mod phases;
pub mod state;
pub mod units;
pub mod wire;
