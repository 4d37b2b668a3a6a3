//! Ferry's data path: manifest, wire protocol, QUIC transport, sender,
//! receiver, staging, publish and the catalog.
//!
//! See ARCHITECTURE.md at the repository root for the map.

pub mod catalog;
pub mod cc;
pub mod manifest;
pub mod paths;
pub mod wire;
