//! Ferry's data path: manifest, wire protocol, QUIC transport, sender,
//! receiver, staging, publish and the catalog.

pub mod tls;
