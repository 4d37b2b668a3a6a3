//! The parts of the TUN emulator that do not touch a device, tested with an
//! injected clock: the delay line holding packets until their delivery
//! instant, and the per-direction counters. Every count is of IP packets as
//! the link model sees them: with the devices' offloads on, a GSO
//! super-packet read from a device counts as each of its MTU-sized segments.
//!
//! The link model itself (rate cap, bounded FIFO with tail drop, delay,
//! jitter, loss) is [`ferry_linkemu::LinkModel`], shared with the
//! in-process emulator the tests and `ferry demo` use.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::{Duration, Instant};

use ferry_linkemu::{DropReason, LinkModel, Verdict};
use serde::Serialize;

/// IP protocol number of TCP (IANA "Assigned Internet Protocol Numbers").
pub const IPPROTO_TCP: u8 = 6;
/// IP protocol number of UDP (IANA "Assigned Internet Protocol Numbers").
pub const IPPROTO_UDP: u8 = 17;

/// Packets waiting for their delivery instant, released in instant order
/// (ties in offer order).
///
/// Each held buffer may start with `headroom` bytes that are not part of the
/// packet (room the writer fills with a `virtio_net_hdr` when the egress
/// device has offloads on); [`DelayLine::bytes`] counts packet bytes only.
#[derive(Debug, Default)]
pub struct DelayLine {
    heap: BinaryHeap<Reverse<Held>>,
    next_seq: u64,
    bytes: u64,
    headroom: usize,
}

/// A held packet, ordered by (delivery instant, offer sequence) only.
#[derive(Debug)]
struct Held {
    at: Instant,
    seq: u64,
    packet: Vec<u8>,
}

impl PartialEq for Held {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Held {}

impl PartialOrd for Held {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Held {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

impl DelayLine {
    /// An empty line whose buffers are the packets themselves.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty line whose buffers start with `headroom` bytes before the
    /// packet.
    pub fn with_headroom(headroom: usize) -> Self {
        Self {
            headroom,
            ..Self::default()
        }
    }

    /// Bytes before the packet in each held buffer.
    pub fn headroom(&self) -> usize {
        self.headroom
    }

    /// Holds `buf` (headroom, then the packet) until `at`.
    pub fn push(&mut self, at: Instant, buf: Vec<u8>) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.bytes += buf.len().saturating_sub(self.headroom) as u64;
        self.heap.push(Reverse(Held {
            at,
            seq,
            packet: buf,
        }));
    }

    /// Delivery instant of the next packet, if any.
    pub fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse(h)| h.at)
    }

    /// Number of packets held.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// Whether no packet is held.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// Packet bytes held (headroom not counted).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Moves every buffer due by `now + window` into `out`, in delivery
    /// order. `window` lets one wake-up release packets due a few
    /// microseconds later instead of sleeping again for each (the caller's
    /// timer precision bound); it is the most a packet is released early.
    pub fn pop_due(&mut self, now: Instant, window: Duration, out: &mut Vec<Vec<u8>>) {
        let limit = now + window;
        while self.heap.peek().is_some_and(|Reverse(h)| h.at <= limit) {
            if let Some(Reverse(h)) = self.heap.pop() {
                self.bytes -= h.packet.len().saturating_sub(self.headroom) as u64;
                out.push(h.packet);
            }
        }
    }
}

/// Offers `segments`, IP packets read from the ingress device at `now` (one
/// packet, or the MTU-sized segments of one GSO super-packet), to `model`
/// one at a time, so each is charged by the rate cap, can be tail-dropped
/// by the queue and lost at random, and gets its own delivery instant. Each
/// delivered segment is copied into `line` behind the line's headroom.
/// Counts every segment in `stats` (`offered_packets`, drops,
/// `max_held_bytes`). Returns whether the line's first delivery instant
/// became earlier (the writer has to wake).
pub fn offer_segments<'a>(
    model: &mut LinkModel,
    line: &mut DelayLine,
    stats: &mut DirectionStats,
    now: Instant,
    segments: impl IntoIterator<Item = &'a [u8]>,
) -> bool {
    let was_next = line.next_due();
    let mut earliest: Option<Instant> = None;
    for seg in segments {
        stats.offered_packets += 1;
        match model.offer_packet(now, seg.len()) {
            // No copies: wanem leaves `duplicate` at 0.
            Verdict::Deliver { at, .. } => {
                let mut buf = Vec::with_capacity(line.headroom() + seg.len());
                buf.resize(line.headroom(), 0);
                buf.extend_from_slice(seg);
                line.push(at, buf);
                earliest = Some(earliest.map_or(at, |e| e.min(at)));
            }
            Verdict::Drop(DropReason::Loss) => stats.dropped_loss += 1,
            Verdict::Drop(DropReason::QueueFull) => stats.dropped_queue += 1,
            // wanem never cuts its link.
            Verdict::Drop(DropReason::Cut) => stats.dropped_loss += 1,
        }
    }
    stats.max_held_bytes = stats.max_held_bytes.max(line.bytes());
    earliest.is_some_and(|at| was_next.is_none_or(|next| at < next))
}

/// The IP protocol number of an IPv4 or IPv6 packet (for IPv6 the first
/// next-header, without walking extension headers); `None` when the packet
/// is too short or of another IP version.
pub fn ip_protocol(packet: &[u8]) -> Option<u8> {
    match packet.first()? >> 4 {
        4 => packet.get(9).copied(),
        6 => packet.get(6).copied(),
        _ => None,
    }
}

/// Counters of one direction, as written to the stats file.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DirectionStats {
    /// Packets read from the ingress device and offered to the link model
    /// (with offloads, each segment of a GSO super-packet counts).
    pub offered_packets: u64,
    /// Reads from the ingress device (with offloads, one read can bring a
    /// GSO super-packet of many segments).
    pub ingress_reads: u64,
    /// Reads whose GSO super-packet could not be split into segments
    /// (malformed `virtio_net_hdr` or headers); their packets are dropped
    /// and not counted in `offered_packets`.
    pub split_errors: u64,
    /// Packets written to the egress device.
    pub delivered_packets: u64,
    /// IP bytes written to the egress device.
    pub delivered_bytes: u64,
    /// Of which TCP.
    pub delivered_tcp_bytes: u64,
    /// Of which UDP.
    pub delivered_udp_bytes: u64,
    /// Packets dropped at random (`--loss`).
    pub dropped_loss: u64,
    /// Packets tail-dropped because the queue was full.
    pub dropped_queue: u64,
    /// Packets the egress device refused (write errors).
    pub write_errors: u64,
    /// Largest number of bytes held in the delay line at once.
    pub max_held_bytes: u64,
}

impl DirectionStats {
    /// Counts one delivered packet.
    pub fn delivered(&mut self, packet: &[u8]) {
        let n = packet.len() as u64;
        self.delivered_packets += 1;
        self.delivered_bytes += n;
        match ip_protocol(packet) {
            Some(IPPROTO_TCP) => self.delivered_tcp_bytes += n,
            Some(IPPROTO_UDP) => self.delivered_udp_bytes += n,
            _ => {}
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use ferry_linkemu::{LinkModel, LinkParams, Verdict};

    fn packet(proto: u8, len: usize) -> Vec<u8> {
        let mut p = vec![0u8; len];
        p[0] = 0x45;
        p[9] = proto;
        p
    }

    #[test]
    fn delay_line_releases_in_instant_order_within_the_window() {
        let t0 = Instant::now();
        let us = Duration::from_micros(1);
        let mut line = DelayLine::new();
        line.push(t0 + 300 * us, vec![3]);
        line.push(t0 + 100 * us, vec![1]);
        line.push(t0 + 100 * us, vec![2]);
        line.push(t0 + 1000 * us, vec![4]);
        assert_eq!((line.len(), line.bytes()), (4, 4));
        assert_eq!(line.next_due(), Some(t0 + 100 * us));
        let mut out = Vec::new();
        line.pop_due(t0, 50 * us, &mut out);
        assert!(out.is_empty());
        line.pop_due(t0 + 60 * us, 50 * us, &mut out);
        assert_eq!(out, vec![vec![1], vec![2]]);
        out.clear();
        line.pop_due(t0 + 260 * us, 50 * us, &mut out);
        assert_eq!(out, vec![vec![3]]);
        assert_eq!(line.next_due(), Some(t0 + 1000 * us));
        out.clear();
        line.pop_due(t0 + Duration::from_secs(1), Duration::ZERO, &mut out);
        assert_eq!(out, vec![vec![4]]);
        assert!(line.is_empty() && line.bytes() == 0 && line.next_due().is_none());
    }

    /// The emulator's whole per-packet path on a simulated clock: 1 Gbit/s,
    /// 100 ms RTT, a BDP queue, packets offered at twice the rate. Every
    /// delivered packet leaves the line exactly at its instant, one one-way
    /// delay after its serialisation, and the long-run rate is the cap.
    #[test]
    fn model_and_line_deliver_at_the_cap_after_the_delay() {
        let params = LinkParams::new(1_000_000_000, Duration::from_millis(100));
        let mut model = LinkModel::new(params.clone());
        let mut line = DelayLine::new();
        let t0 = Instant::now();
        let mut delivered = Vec::new();
        let mut first_at = None;
        let mut last_at = t0;
        // 1500-byte packets every 6 µs = 2 Gbit/s for 0.6 s.
        for i in 0..100_000u32 {
            let now = t0 + Duration::from_micros(6) * i;
            line.pop_due(now, Duration::ZERO, &mut delivered);
            if let Verdict::Deliver { at, .. } = model.offer_packet(now, 1500) {
                first_at.get_or_insert(at);
                last_at = at;
                line.push(at, packet(IPPROTO_UDP, 1500));
            }
        }
        let first_at = first_at.unwrap();
        // The first packet: 12 µs on the wire, then 50 ms.
        assert_eq!(first_at - t0, Duration::from_micros(50_012));
        let stats = model.stats();
        assert!(stats.dropped_queue > 0, "{stats:?}");
        // Rate between first and last delivery = the cap.
        let bits = (stats.delivered_packets - 1) as f64 * 1500.0 * 8.0;
        let rate = bits / (last_at - first_at).as_secs_f64();
        assert!((rate / 1e9 - 1.0).abs() < 1e-3, "rate {rate}");
        // The queue never held more than one BDP (12.5 MB) beyond the wire.
        assert!(model.backlog_bytes(t0 + Duration::from_millis(600)) <= 12_500_000);
        line.pop_due(last_at, Duration::ZERO, &mut delivered);
        assert_eq!(delivered.len() as u64, stats.delivered_packets);
    }

    /// The segments of one GSO super-packet, all read at one instant, are
    /// charged one by one: consecutive delivery instants one serialisation
    /// time apart, tail drop once the queue is full, every segment counted.
    #[test]
    fn segments_of_one_read_are_charged_one_by_one() {
        let mut params = LinkParams::new(1_000_000_000, Duration::from_millis(100));
        // Room for 10 segments of 1500 bytes behind the one on the wire.
        params.queue_bytes = 15_000;
        let mut model = LinkModel::new(params);
        let mut line = DelayLine::with_headroom(12);
        let mut stats = DirectionStats::default();
        let t0 = Instant::now();
        let segs: Vec<Vec<u8>> = (0..45).map(|_| packet(IPPROTO_TCP, 1500)).collect();
        let wake = offer_segments(
            &mut model,
            &mut line,
            &mut stats,
            t0,
            segs.iter().map(Vec::as_slice),
        );
        assert!(wake);
        assert_eq!(stats.offered_packets, 45);
        let held = line.len() as u64;
        assert!((10..=12).contains(&held), "held {held}");
        assert_eq!(stats.dropped_queue, 45 - held);
        assert_eq!(line.bytes(), held * 1500);
        assert_eq!(stats.max_held_bytes, held * 1500);
        let mut out = Vec::new();
        line.pop_due(t0 + Duration::from_secs(1), Duration::ZERO, &mut out);
        assert!(out.iter().all(|b| b.len() == 12 + 1500 && b[12] == 0x45));
        // Into the emptied line, an offer wakes the writer; one due after
        // it does not.
        let later = offer_segments(
            &mut model,
            &mut line,
            &mut stats,
            t0 + Duration::from_millis(1),
            [packet(IPPROTO_UDP, 1200).as_slice()],
        );
        assert!(later);
        let not_first = offer_segments(
            &mut model,
            &mut line,
            &mut stats,
            t0 + Duration::from_millis(1),
            [packet(IPPROTO_UDP, 1200).as_slice()],
        );
        assert!(!not_first);
    }

    /// Delivery instants of segments offered at one instant are one
    /// serialisation time (12 µs for 1500 bytes at 1 Gbit/s) apart.
    #[test]
    fn segments_of_one_read_are_serialised_back_to_back() {
        let params = LinkParams::new(1_000_000_000, Duration::from_millis(100));
        let mut model = LinkModel::new(params);
        let t0 = Instant::now();
        let mut ats = Vec::new();
        for _ in 0..45 {
            if let Verdict::Deliver { at, .. } = model.offer_packet(t0, 1500) {
                ats.push(at);
            }
        }
        let mut line = DelayLine::new();
        let mut stats = DirectionStats::default();
        let mut model2 = LinkModel::new(LinkParams::new(1_000_000_000, Duration::from_millis(100)));
        let segs: Vec<Vec<u8>> = (0..45).map(|_| packet(IPPROTO_TCP, 1500)).collect();
        offer_segments(
            &mut model2,
            &mut line,
            &mut stats,
            t0,
            segs.iter().map(Vec::as_slice),
        );
        assert_eq!(line.len(), 45);
        assert_eq!(ats.len(), 45);
        for w in ats.windows(2) {
            assert_eq!(w[1] - w[0], Duration::from_micros(12));
        }
        let mut got = Vec::new();
        while let Some(at) = line.next_due() {
            got.push(at);
            let mut out = Vec::new();
            line.pop_due(at, Duration::ZERO, &mut out);
            assert_eq!(out.len(), 1);
        }
        assert_eq!(got, ats);
    }

    #[test]
    fn delay_line_headroom_is_not_counted_as_packet_bytes() {
        let t0 = Instant::now();
        let mut line = DelayLine::with_headroom(10);
        assert_eq!(line.headroom(), 10);
        line.push(t0, vec![0u8; 10 + 1500]);
        line.push(t0, vec![0u8; 10 + 84]);
        assert_eq!((line.len(), line.bytes()), (2, 1584));
        let mut out = Vec::new();
        line.pop_due(t0, Duration::ZERO, &mut out);
        assert_eq!(out.iter().map(Vec::len).collect::<Vec<_>>(), [1510, 94]);
        assert_eq!(line.bytes(), 0);
    }

    #[test]
    fn stats_split_tcp_and_udp_bytes() {
        let mut s = DirectionStats::default();
        s.delivered(&packet(IPPROTO_TCP, 1500));
        s.delivered(&packet(IPPROTO_UDP, 1200));
        s.delivered(&packet(1, 84));
        s.delivered(&[0x60, 0, 0, 0, 0, 0, IPPROTO_UDP, 0]);
        assert_eq!(s.delivered_packets, 4);
        assert_eq!(s.delivered_bytes, 1500 + 1200 + 84 + 8);
        assert_eq!(s.delivered_tcp_bytes, 1500);
        assert_eq!(s.delivered_udp_bytes, 1208);
        assert_eq!(ip_protocol(&[]), None);
        assert_eq!(ip_protocol(&[0x45]), None);
    }
}
