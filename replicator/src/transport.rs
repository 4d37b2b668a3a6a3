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
/// share-aware congestion controller replaces Cubic.
///
/// Why more than one BDP: data behind a lost packet waits about 1.5 RTT
/// for the retransmission and holds flow-control credit meanwhile. Measured
/// with `ferry demo --loss 0.01` (1 Gbit/s, 100 ms): one BDP per stream and
/// two per connection gave 0.72 of the link, two and four gave 0.89.
pub fn transport_config(tuning: Tuning, share: Option<Share>) -> TransportConfig {
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
    /// An in-memory emulated link ([`crate::linkemu`]).
    Memory(Arc<dyn quinn::AsyncUdpSocket>),
}

/// Creates a QUIC endpoint on `socket`, accepting connections when
/// `server` is given.
///
/// # Errors
/// Bind errors.
pub fn endpoint(socket: SocketKind, server: Option<quinn::ServerConfig>) -> io::Result<Endpoint> {
    let runtime = Arc::new(quinn::TokioRuntime);
    match socket {
        SocketKind::Udp(addr) => Endpoint::new(
            EndpointConfig::default(),
            server,
            udp_socket(addr)?,
            runtime,
        ),
        SocketKind::Memory(s) => {
            Endpoint::new_with_abstract_socket(EndpointConfig::default(), server, s, runtime)
        }
    }
}

#[cfg(test)]
mod tests {
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
}
