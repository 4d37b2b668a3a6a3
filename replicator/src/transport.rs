//! QUIC endpoints tuned for a long fat pipe: flow-control windows from the
//! link's rate x RTT, large UDP socket buffers, and the share-aware
//! congestion controller ([`crate::cc`]).

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use quinn::{Endpoint, EndpointConfig, IdleTimeout, TransportConfig, VarInt};
use socket2::{Domain, Protocol, Socket, Type};

use crate::cc::{Share, ShareControllerFactory};

/// UDP socket buffer size requested, in bytes (64 MiB). The kernel default
/// (about 208 KiB) makes a 1 Gbit/s receiver drop bursts (seen as
/// `RcvbufErrors`), which cut Cubic to 0.16-0.23 of the link in the
/// measurements quoted in the spine issue.
pub const SOCKET_BUFFER: usize = 64 << 20;

/// A connection with no packet from the peer for this long is dead (a
/// crashed agent or a cut link); transfers then resume on a new one.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// Rate and RTT that size a connection's windows.
#[derive(Debug, Clone, Copy)]
pub struct Tuning {
    /// Link rate cap in bit/s.
    pub rate_bps: u64,
    /// Base round-trip time.
    pub rtt: Duration,
}

impl Tuning {
    /// Bandwidth-delay product in bytes: `rate / 8 x RTT`.
    pub fn bdp(&self) -> u64 {
        (self.rate_bps as f64 / 8.0 * self.rtt.as_secs_f64()) as u64
    }
}

fn varint(v: u64) -> VarInt {
    VarInt::from_u64(v.min((1 << 62) - 1)).unwrap_or(VarInt::MAX)
}

/// Transport parameters for a link with `tuning`: per-stream receive
/// window two BDP (at least 8 MiB), connection receive and send windows
/// four BDP (at least 16 MiB), up to 1024 concurrent data streams, initial
/// RTT from the hint, 2 s keep-alive, [`IDLE_TIMEOUT`]. With `share`, the
/// share-aware congestion controller replaces Cubic, aiming at the share
/// split over `connections` (the link's connections together keep the
/// share; see [`crate::cc::ShareControllerFactory`]).
///
/// Streams of one priority share the connection round-robin (quinn's
/// `send_fairness`, on by default). With it off, quinn finishes a stream
/// it has started before any other, even one of a higher priority: a
/// lower-class batch then holds urgent bytes back (`ferry demo --priority`
/// measured 2.08 x solo and 28.5 RTT of pre-emption latency with it off,
/// 1.12-1.24 x and 2.7-7.0 RTT with it on, in the same session).
///
/// Why more than one BDP: data behind a lost packet waits about 1.5 RTT
/// for the retransmission and holds flow-control credit meanwhile. Measured
/// with `ferry demo --loss 0.01` (1 Gbit/s, 100 ms): one BDP per stream and
/// two per connection gave 0.72 of the link, two and four gave 0.89.
pub fn transport_config(tuning: Tuning, share: Option<Share>, connections: u32) -> TransportConfig {
    let bdp = tuning.bdp();
    let mut t = TransportConfig::default();
    t.stream_receive_window(varint((2 * bdp).max(8 << 20)))
        .receive_window(varint((4 * bdp).max(16 << 20)))
        .send_window((4 * bdp).max(16 << 20))
        .max_concurrent_uni_streams(VarInt::from_u32(1024))
        .max_concurrent_bidi_streams(VarInt::from_u32(16))
        .initial_rtt(tuning.rtt)
        .keep_alive_interval(Some(Duration::from_secs(2)))
        .max_idle_timeout(IdleTimeout::try_from(IDLE_TIMEOUT).ok())
        .datagram_receive_buffer_size(None);
    if let Some(share) = share {
        t.congestion_controller_factory(Arc::new(ShareControllerFactory {
            share,
            rtt_hint: tuning.rtt,
            connections: connections.max(1),
        }));
    }
    t
}

/// Binds a UDP socket with [`SOCKET_BUFFER`]-byte buffers. When the
/// kernel's `net.core.rmem_max` caps the request, `SO_RCVBUFFORCE` is tried
/// (works as root); otherwise the capped size is used and a warning logged.
///
/// # Errors
/// The bind error, naming the address.
pub fn udp_socket(addr: SocketAddr) -> io::Result<std::net::UdpSocket> {
    let sock = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    let _ = sock.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = sock.set_send_buffer_size(SOCKET_BUFFER);
    if sock.recv_buffer_size().unwrap_or(0) < SOCKET_BUFFER {
        use std::os::fd::AsFd;
        let _ = nix::sys::socket::setsockopt(
            &sock.as_fd(),
            nix::sys::socket::sockopt::RcvBufForce,
            &SOCKET_BUFFER,
        );
        let _ = nix::sys::socket::setsockopt(
            &sock.as_fd(),
            nix::sys::socket::sockopt::SndBufForce,
            &SOCKET_BUFFER,
        );
    }
    let got = sock.recv_buffer_size().unwrap_or(0);
    if got < SOCKET_BUFFER / 2 {
        tracing::warn!(
            requested = SOCKET_BUFFER,
            got,
            "UDP receive buffer capped by net.core.rmem_max; raise it (sysctl) or run as root for full rate"
        );
    }
    sock.bind(&addr.into())
        .map_err(|e| io::Error::new(e.kind(), format!("bind UDP {addr}: {e}")))?;
    Ok(sock.into())
}

/// Where an endpoint sends its datagrams.
#[derive(Debug, Clone)]
pub enum SocketKind {
    /// A real UDP socket bound to this address.
    Udp(SocketAddr),
    /// Any other datagram socket, e.g. one end of the in-memory emulated
    /// link of the `ferry-linkemu` crate (`memory_pair`).
    Memory(Arc<dyn quinn::AsyncUdpSocket>),
}

/// Makes the sockets of a link's further connections (the first uses the
/// agent's endpoint): each connection of a link gets its own endpoint and
/// socket, so the kernel and the runtime can spread their packets over
/// cores.
#[derive(Clone)]
pub enum SocketFactory {
    /// A new UDP socket bound to this address (port 0: any free port) per
    /// connection, with [`SOCKET_BUFFER`]-byte buffers.
    Udp(SocketAddr),
    /// Sockets made by this function, e.g. more source-side ends of the
    /// in-memory emulated link (`ferry_linkemu::MemorySocket::sibling`).
    Custom(Arc<dyn Fn() -> io::Result<Arc<dyn quinn::AsyncUdpSocket>> + Send + Sync>),
}

impl std::fmt::Debug for SocketFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SocketFactory::Udp(a) => write!(f, "Udp({a})"),
            SocketFactory::Custom(_) => f.write_str("Custom"),
        }
    }
}

impl SocketFactory {
    /// A new client endpoint (no server role) on a new socket.
    ///
    /// # Errors
    /// Bind errors, or the function's error.
    pub fn endpoint(&self) -> io::Result<Endpoint> {
        match self {
            SocketFactory::Udp(addr) => endpoint(SocketKind::Udp(*addr), None),
            SocketFactory::Custom(make) => endpoint(SocketKind::Memory(make()?), None),
        }
    }
}

/// Creates a QUIC endpoint on `socket`, accepting connections when
/// `server` is given, with a random stateless-reset key.
///
/// # Errors
/// Bind errors.
pub fn endpoint(socket: SocketKind, server: Option<quinn::ServerConfig>) -> io::Result<Endpoint> {
    endpoint_with_reset_key(socket, server, None)
}

/// As [`endpoint`], with the stateless-reset key `reset_key` (32 secret
/// bytes) when given; the connection-ID generator's key is derived from it
/// too. An agent that restarts on the same address with the
/// same key answers packets of its peers' old connections with a
/// stateless reset (RFC 9000, section 10.3) that they accept, so they
/// reconnect within a round trip instead of waiting [`IDLE_TIMEOUT`].
///
/// # Errors
/// Bind errors.
pub fn endpoint_with_reset_key(
    socket: SocketKind,
    server: Option<quinn::ServerConfig>,
    reset_key: Option<[u8; 32]>,
) -> io::Result<Endpoint> {
    let runtime = Arc::new(quinn::TokioRuntime);
    let mut config = EndpointConfig::default();
    if let Some(key) = reset_key {
        // Connection IDs must also validate after the restart, or packets
        // of the old connections are dropped unanswered: the ID generator's
        // key comes from the same secret.
        let cid_key = *blake3::keyed_hash(&key, b"connection id generator key").as_bytes();
        config
            .reset_key(Arc::new(ResetKey(key)))
            .cid_generator(move || Box::new(KeyedCidGenerator { key: cid_key }));
    }
    match socket {
        SocketKind::Udp(addr) => Endpoint::new(config, server, udp_socket(addr)?, runtime),
        SocketKind::Memory(s) => Endpoint::new_with_abstract_socket(config, server, s, runtime),
    }
}

/// Connection IDs of [`CID_NONCE_BYTES`] random bytes followed by
/// [`CID_TAG_BYTES`] of their BLAKE3 keyed hash: 64 random bits make a
/// repeated ID (and so a repeated stateless-reset token under a key that
/// lasts across restarts, which RFC 9000 section 10.3.2 rules out) as
/// unlikely as a random 64-bit collision, and the keyed tag lets a
/// restarted endpoint recognise its own IDs without letting an observer
/// forge them. (quinn's default generator has a 3-byte nonce and a
/// non-cryptographic tag, fine with a per-start random key but not with a
/// lasting one.)
struct KeyedCidGenerator {
    key: [u8; 32],
}

/// Random bytes at the start of a [`KeyedCidGenerator`] connection ID.
const CID_NONCE_BYTES: usize = 8;
/// Tag bytes at the end of a [`KeyedCidGenerator`] connection ID.
const CID_TAG_BYTES: usize = 8;

impl KeyedCidGenerator {
    fn tag(&self, nonce: &[u8]) -> [u8; CID_TAG_BYTES] {
        let mut tag = [0u8; CID_TAG_BYTES];
        tag.copy_from_slice(&blake3::keyed_hash(&self.key, nonce).as_bytes()[..CID_TAG_BYTES]);
        tag
    }
}

impl quinn_proto::ConnectionIdGenerator for KeyedCidGenerator {
    fn generate_cid(&mut self) -> quinn_proto::ConnectionId {
        let nonce: [u8; CID_NONCE_BYTES] = rand::random();
        let mut id = [0u8; CID_NONCE_BYTES + CID_TAG_BYTES];
        id[..CID_NONCE_BYTES].copy_from_slice(&nonce);
        id[CID_NONCE_BYTES..].copy_from_slice(&self.tag(&nonce));
        quinn_proto::ConnectionId::new(&id)
    }

    fn validate(&self, cid: &quinn_proto::ConnectionId) -> Result<(), quinn_proto::InvalidCid> {
        if cid.len() == CID_NONCE_BYTES + CID_TAG_BYTES
            && cid[CID_NONCE_BYTES..] == self.tag(&cid[..CID_NONCE_BYTES])
        {
            Ok(())
        } else {
            Err(quinn_proto::InvalidCid)
        }
    }

    fn cid_len(&self) -> usize {
        CID_NONCE_BYTES + CID_TAG_BYTES
    }

    fn cid_lifetime(&self) -> Option<Duration> {
        None
    }
}

/// Stateless-reset tokens as a BLAKE3 keyed hash of the connection ID
/// (32-byte output; QUIC uses the first 16 bytes).
struct ResetKey([u8; 32]);

impl quinn::crypto::HmacKey for ResetKey {
    fn sign(&self, data: &[u8], signature_out: &mut [u8]) {
        let tag = blake3::keyed_hash(&self.0, data);
        let n = signature_out.len().min(32);
        signature_out[..n].copy_from_slice(&tag.as_bytes()[..n]);
    }

    fn signature_len(&self) -> usize {
        32
    }

    fn verify(&self, data: &[u8], signature: &[u8]) -> Result<(), quinn::crypto::CryptoError> {
        let tag = <[u8; 32]>::try_from(signature).map_err(|_| quinn::crypto::CryptoError)?;
        // `blake3::Hash` compares in constant time.
        if blake3::keyed_hash(&self.0, data) == blake3::Hash::from_bytes(tag) {
            Ok(())
        } else {
            Err(quinn::crypto::CryptoError)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use quinn::crypto::HmacKey;
    use quinn_proto::ConnectionIdGenerator;

    use super::*;

    #[test]
    fn windows_follow_the_bdp() {
        let t = Tuning {
            rate_bps: 1_000_000_000,
            rtt: Duration::from_millis(100),
        };
        assert_eq!(t.bdp(), 12_500_000);
        let t = Tuning {
            rate_bps: 10_000_000_000,
            rtt: Duration::from_millis(200),
        };
        assert_eq!(t.bdp(), 250_000_000);
    }

    #[test]
    fn udp_socket_binds_with_large_buffers() {
        let s = udp_socket("127.0.0.1:0".parse().expect("addr")).expect("bind");
        let s2 = Socket::from(s);
        // The kernel doubles the value; anything above the 208 KiB default
        // shows the request was applied (root may exceed rmem_max).
        if nix::unistd::geteuid().is_root() {
            assert!(s2.recv_buffer_size().expect("size") > 1 << 20);
        }
    }

    #[test]
    fn connection_ids_validate_only_under_their_key_and_do_not_repeat() {
        let mut a = KeyedCidGenerator { key: [1; 32] };
        let b = KeyedCidGenerator { key: [2; 32] };
        let ids: Vec<_> = (0..1000).map(|_| a.generate_cid()).collect();
        for id in &ids {
            assert_eq!(id.len(), 16);
            assert!(a.validate(id).is_ok());
            // The same key after a restart recognises it; another does not.
            assert!(KeyedCidGenerator { key: [1; 32] }.validate(id).is_ok());
            assert!(b.validate(id).is_err());
        }
        let distinct: std::collections::HashSet<_> = ids.iter().map(|i| i.to_vec()).collect();
        assert_eq!(distinct.len(), ids.len());
        // A forged or short ID is refused.
        let mut forged = ids[0].to_vec();
        forged[15] ^= 1;
        assert!(a
            .validate(&quinn_proto::ConnectionId::new(&forged))
            .is_err());
        assert!(a
            .validate(&quinn_proto::ConnectionId::new(&[0; 8]))
            .is_err());
    }

    #[test]
    fn reset_tokens_verify_only_under_the_same_key() {
        let (a, b) = (ResetKey([7; 32]), ResetKey([8; 32]));
        let mut tag = vec![0u8; a.signature_len()];
        a.sign(b"connection id", &mut tag);
        assert!(a.verify(b"connection id", &tag).is_ok());
        // The same key after a restart gives the same token.
        let mut again = vec![0u8; 32];
        ResetKey([7; 32]).sign(b"connection id", &mut again);
        assert_eq!(tag, again);
        assert!(b.verify(b"connection id", &tag).is_err());
        assert!(a.verify(b"another id", &tag).is_err());
        assert!(a.verify(b"connection id", &tag[..16]).is_err());
        // A short output buffer gets a prefix (QUIC takes 16 bytes).
        let mut short = [0u8; 16];
        a.sign(b"connection id", &mut short);
        assert_eq!(&short[..], &tag[..16]);
    }
}
