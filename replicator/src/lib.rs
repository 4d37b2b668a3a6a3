//! Ferry's data path: manifest, wire protocol, QUIC transport, sender,
//! receiver, staging, publish and the catalog.
//!
//! See ARCHITECTURE.md at the repository root for the map.

pub mod bufpool;
pub mod cc;
pub mod conn;
pub mod formats;
pub mod hold;
mod lock;
pub mod metrics;
pub mod pool;
pub mod settings;
pub mod sink;
pub mod source;
pub mod storage;
pub mod tls;
pub mod transport;
pub mod verify;
