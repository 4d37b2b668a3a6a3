//! Link emulation without root privileges.
//!
//! One sans-IO model of a bottleneck link ([`LinkModel`]: rate cap, bounded
//! FIFO queue, propagation delay with jitter, random loss, corruption and
//! duplication, and a cut) drives two transports:
//!
//! * [`spawn_relay`]: a UDP relay between real sockets, for separate
//!   processes; it can also cut the link ([`Relay::set_cut`]);
//! * [`memory_pair`]: two in-process [`quinn::AsyncUdpSocket`]s joined by an
//!   emulated link, for agents inside one process.
//!
//! Both deliver datagrams in the order of the instants the model hands out
//! (offer order among equal instants), so jitter with
//! [`LinkParams::reorder`] really reorders them, and without it nothing is
//! reordered.
//!
//! Sizes are counted in *wire bytes*: UDP payload length plus
//! [`WIRE_OVERHEAD_BYTES`] (20 bytes IPv4 header + 8 bytes UDP header).

use std::cmp::{Ordering, Reverse};
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use quinn::udp::{EcnCodepoint, RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;
use tokio::sync::Notify;
use tokio::task::{AbortHandle, JoinHandle};

/// Bytes added to every UDP payload to get its size on the wire
/// (IPv4 header 20 bytes + UDP header 8 bytes).
pub const WIRE_OVERHEAD_BYTES: u64 = 28;

/// Socket buffer size (bytes) the relay asks the kernel for, per socket and direction.
const SOCKET_BUFFER_BYTES: usize = 64 << 20;

/// Largest UDP payload the relay can receive (bytes).
const MAX_DATAGRAM_BYTES: usize = 65_536;

const NANOS_PER_SEC: u128 = 1_000_000_000;

/// Parameters of one direction of an emulated link.
#[derive(Debug, Clone, PartialEq)]
pub struct LinkParams {
    /// Bottleneck rate in bit/s, applied to wire bytes. `0` means unlimited
    /// (no serialisation delay and no queueing).
    pub rate_bps: u64,
    /// Propagation delay added to every datagram after serialisation.
    pub one_way_delay: Duration,
    /// Capacity of the FIFO in front of the bottleneck, in wire bytes.
    pub queue_bytes: u64,
    /// Probability (0..=1) that a datagram is dropped at random.
    pub loss: f64,
    /// Probability (0..=1) that a delivered datagram gets one byte flipped.
    pub corrupt: f64,
    /// Seed of the random number generator used for loss, corruption,
    /// jitter and duplication (same seed and same offers, same decisions).
    pub seed: u64,
    /// Jitter: each datagram's propagation delay is `one_way_delay` plus a
    /// uniform offset in `[-jitter, +jitter]` (never below zero), as netem's
    /// uniform jitter. Zero by default.
    pub jitter: Duration,
    /// Whether jitter may reorder datagrams. When `false` (the default) a
    /// datagram is never delivered before the one offered before it, so
    /// jitter only bunches datagrams up (and TCP sees no false reordering).
    /// When `true`, each datagram arrives at its own instant, earlier ones
    /// overtaken by later ones whose jitter is smaller.
    pub reorder: bool,
    /// Probability (0..=1) that a delivered datagram is delivered twice, as
    /// netem's `duplicate`. The copy is byte-identical to the original as
    /// delivered (corrupted too if the original is). It takes link capacity
    /// like any datagram: it is serialised right after the original (and
    /// tail-dropped, counted in [`LinkStats::dropped_queue`], if the queue
    /// has no room left for it) and has the original's propagation delay,
    /// so it arrives one serialisation time (its wire bytes x 8 / rate)
    /// after the original; on an unlimited link, at the same instant, just
    /// after it. Zero by default.
    pub duplicate: f64,
}

impl LinkParams {
    /// A loss-free link of `rate_bps` bit/s with round-trip time `rtt`:
    /// one-way delay is `rtt / 2` and the queue holds one bandwidth-delay
    /// product (`rate_bps / 8 * rtt` bytes). Seed is 0.
    pub fn new(rate_bps: u64, rtt: Duration) -> Self {
        let bdp = u128::from(rate_bps) * rtt.as_nanos() / (8 * NANOS_PER_SEC);
        Self {
            rate_bps,
            one_way_delay: rtt / 2,
            queue_bytes: u64::try_from(bdp).unwrap_or(u64::MAX),
            loss: 0.0,
            corrupt: 0.0,
            seed: 0,
            jitter: Duration::ZERO,
            reorder: false,
            duplicate: 0.0,
        }
    }
}

/// Outcome of offering a datagram to a [`LinkModel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Deliver the datagram at `at`; if `corrupt`, flip one byte first
    /// (see [`LinkModel::corrupt_in_place`]); if `duplicate_at` is set,
    /// deliver the same bytes a second time then (see
    /// [`LinkParams::duplicate`]).
    Deliver {
        /// Instant the last bit arrives at the far end.
        at: Instant,
        /// Whether the datagram is to be corrupted.
        corrupt: bool,
        /// Instant the copy arrives, if the datagram is duplicated (never
        /// before `at`).
        duplicate_at: Option<Instant>,
    },
    /// The datagram is lost.
    Drop(DropReason),
}

/// Why a datagram was dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropReason {
    /// Random loss (probability [`LinkParams::loss`]).
    Loss,
    /// Tail drop: the queue would exceed [`LinkParams::queue_bytes`].
    QueueFull,
    /// The link is cut ([`LinkModel::set_cut`]).
    Cut,
}

/// Counters of one link direction, in datagrams (or IP packets, for
/// [`LinkModel::offer_packet`]) unless stated otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Datagrams accepted for delivery, copies made by duplication
    /// included, minus those a cut discarded in flight.
    pub delivered_packets: u64,
    /// UDP payload bytes (IP bytes for [`LinkModel::offer_packet`]) of the
    /// delivered datagrams.
    pub delivered_bytes: u64,
    /// Datagrams dropped at random.
    pub dropped_loss: u64,
    /// Datagrams tail-dropped because the queue was full (copies made by
    /// duplication included).
    pub dropped_queue: u64,
    /// Delivered datagrams marked for corruption.
    pub corrupted: u64,
    /// Datagrams dropped because the link was cut: offered while it was
    /// cut, or (in the relay) falling due while it was cut.
    pub dropped_cut: u64,
    /// Copies delivered by duplication (each also counted in
    /// `delivered_packets`).
    pub duplicated: u64,
    /// Deliveries scheduled before that of a datagram offered earlier
    /// (only with [`LinkParams::reorder`]; a datagram that arrives at the
    /// same instant as an earlier one still arrives after it).
    pub reordered: u64,
}

/// Sans-IO model of one direction of a bottleneck link.
///
/// A cut link ([`LinkModel::set_cut`]) drops every datagram first. Random
/// loss is applied next (a lost datagram uses no capacity, like netem).
/// Then the router queue: the backlog is the number of wire bytes not yet
/// serialised at `now`; if backlog + wire bytes exceeds the queue size the
/// datagram is tail-dropped (an idle link always accepts). Otherwise it is
/// delivered at `max(now, busy_until) + wire_bytes * 8 / rate +
/// propagation delay` (`one_way_delay` plus jitter), and possibly once more
/// right after ([`LinkParams::duplicate`]). Time is kept as exact integer
/// nanoseconds from the start of the current busy period, so long runs do
/// not drift. Delivery instants never decrease unless
/// [`LinkParams::reorder`] lets jitter reorder them; the relay, the
/// in-memory pair and the TUN emulator in `ops/wanem` deliver in the order
/// of these instants.
#[derive(Debug)]
pub struct LinkModel {
    params: LinkParams,
    rng: StdRng,
    /// Start of the current busy period (`None` before the first offer).
    period_start: Option<Instant>,
    /// Wire bits accepted since `period_start`.
    period_bits: u128,
    /// Latest `now` seen; earlier instants are clamped to it.
    last_now: Option<Instant>,
    /// Latest delivery instant handed out (keeps order under jitter).
    last_at: Option<Instant>,
    /// Whether the link is cut.
    cut: bool,
    stats: LinkStats,
}

impl LinkModel {
    /// A fresh, idle link.
    pub fn new(params: LinkParams) -> Self {
        Self {
            rng: StdRng::seed_from_u64(params.seed),
            params,
            period_start: None,
            period_bits: 0,
            last_now: None,
            last_at: None,
            cut: false,
            stats: LinkStats::default(),
        }
    }

    /// Cuts the link (`true`) or restores it (`false`). While it is cut,
    /// every datagram offered is dropped ([`DropReason::Cut`]) without
    /// using capacity or drawing from the random generator. Datagrams
    /// already accepted keep their delivery instants here; the relay
    /// discards those that fall due while the link is cut (see
    /// [`Relay::set_cut`]).
    pub fn set_cut(&mut self, cut: bool) {
        self.cut = cut;
    }

    /// Whether the link is cut.
    pub fn is_cut(&self) -> bool {
        self.cut
    }

    /// The parameters this model was built with.
    pub fn params(&self) -> &LinkParams {
        &self.params
    }

    /// Counters so far.
    pub fn stats(&self) -> LinkStats {
        self.stats
    }

    /// Wire bytes still waiting to be serialised at `now` (including the
    /// unsent part of the datagram on the wire).
    pub fn backlog_bytes(&self, now: Instant) -> u64 {
        let Some(start) = self.period_start else {
            return 0;
        };
        if self.params.rate_bps == 0 {
            return 0;
        }
        let elapsed = now.saturating_duration_since(start).as_nanos();
        let sent = elapsed * u128::from(self.params.rate_bps) / NANOS_PER_SEC;
        let left = self.period_bits.saturating_sub(sent).div_ceil(8);
        u64::try_from(left).unwrap_or(u64::MAX)
    }

    /// Offer a datagram of `payload_len` UDP payload bytes at `now`; its
    /// size on the wire is `payload_len + WIRE_OVERHEAD_BYTES`.
    pub fn offer(&mut self, now: Instant, payload_len: usize) -> Verdict {
        self.offer_sized(
            now,
            payload_len as u64 + WIRE_OVERHEAD_BYTES,
            payload_len as u64,
        )
    }

    /// Offer an IP packet of `packet_len` bytes (header included) at `now`,
    /// as an IP-layer emulator sees it: the rate cap and queue apply to
    /// `packet_len`, and the delivered-bytes counter counts it.
    pub fn offer_packet(&mut self, now: Instant, packet_len: usize) -> Verdict {
        self.offer_sized(now, packet_len as u64, packet_len as u64)
    }

    fn offer_sized(&mut self, now: Instant, wire: u64, counted: u64) -> Verdict {
        let now = self.last_now.map_or(now, |last| last.max(now));
        self.last_now = Some(now);
        if self.cut {
            self.stats.dropped_cut += 1;
            return Verdict::Drop(DropReason::Cut);
        }
        if self.chance(self.params.loss) {
            self.stats.dropped_loss += 1;
            return Verdict::Drop(DropReason::Loss);
        }
        let Some(serialised) = self.enqueue(now, wire) else {
            self.stats.dropped_queue += 1;
            return Verdict::Drop(DropReason::QueueFull);
        };
        let corrupt = self.chance(self.params.corrupt);
        self.stats.delivered_packets += 1;
        self.stats.delivered_bytes += counted;
        self.stats.corrupted += u64::from(corrupt);
        let delay = self.propagation_delay();
        let at = self.schedule(serialised + delay);
        let duplicate_at = if self.chance(self.params.duplicate) {
            // The copy queues behind the original and shares its delay.
            match self.enqueue(now, wire) {
                Some(serialised) => {
                    self.stats.delivered_packets += 1;
                    self.stats.delivered_bytes += counted;
                    self.stats.duplicated += 1;
                    Some(self.schedule(serialised + delay))
                }
                None => {
                    self.stats.dropped_queue += 1;
                    None
                }
            }
        } else {
            None
        };
        Verdict::Deliver {
            at,
            corrupt,
            duplicate_at,
        }
    }

    /// Puts `wire` bytes into the router queue at `now`: the instant their
    /// last bit is serialised, or `None` if the queue has no room (tail
    /// drop).
    fn enqueue(&mut self, now: Instant, wire: u64) -> Option<Instant> {
        let backlog = self.backlog_bytes(now);
        let start = match self.period_start {
            Some(start) if backlog > 0 => {
                if backlog.saturating_add(wire) > self.params.queue_bytes {
                    return None;
                }
                start
            }
            // Idle link: start a new busy period now.
            _ => {
                self.period_start = Some(now);
                self.period_bits = 0;
                now
            }
        };
        let serialised = if self.params.rate_bps == 0 {
            Duration::ZERO
        } else {
            self.period_bits += u128::from(wire) * 8;
            let nanos =
                (self.period_bits * NANOS_PER_SEC).div_ceil(u128::from(self.params.rate_bps));
            Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
        };
        Some(start + serialised)
    }

    /// The delivery instant of a datagram due at `at`: not before the
    /// latest one handed out unless reordering is allowed.
    fn schedule(&mut self, at: Instant) -> Instant {
        let at = match self.last_at {
            Some(last) if at < last => {
                if !self.params.reorder {
                    last
                } else {
                    self.stats.reordered += 1;
                    at
                }
            }
            _ => at,
        };
        self.last_at = Some(self.last_at.map_or(at, |last| last.max(at)));
        at
    }

    /// Records that a datagram this model delivered (`counted` bytes, a
    /// copy made by duplication if `copy`) was discarded in flight because
    /// the link is cut: it moves from the delivered counters to
    /// [`LinkStats::dropped_cut`].
    fn discarded_in_flight(&mut self, counted: u64, copy: bool) {
        let s = &mut self.stats;
        s.delivered_packets = s.delivered_packets.saturating_sub(1);
        s.delivered_bytes = s.delivered_bytes.saturating_sub(counted);
        if copy {
            s.duplicated = s.duplicated.saturating_sub(1);
        }
        s.dropped_cut += 1;
    }

    /// `one_way_delay` plus this datagram's jitter offset.
    fn propagation_delay(&mut self) -> Duration {
        let base = self.params.one_way_delay;
        let jitter = self.params.jitter;
        if jitter.is_zero() {
            return base;
        }
        let span = jitter.as_nanos() as i128;
        let offset = self.rng.gen_range(-span..=span);
        let nanos = (base.as_nanos() as i128 + offset).max(0);
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// Flip one randomly chosen byte of `datagram` (XOR with a random
    /// non-zero value), using the model's seeded generator.
    pub fn corrupt_in_place(&mut self, datagram: &mut [u8]) {
        if datagram.is_empty() {
            return;
        }
        let i = self.rng.gen_range(0..datagram.len());
        datagram[i] ^= self.rng.gen_range(1..=u8::MAX);
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.gen::<f64>() < p
    }

    /// Offer `data` and, if delivered, return it (corrupted if so decided)
    /// with its delivery instants.
    fn pass(&mut self, now: Instant, data: &[u8]) -> Option<Passed> {
        match self.offer(now, data.len()) {
            Verdict::Deliver {
                at,
                corrupt,
                duplicate_at,
            } => {
                let mut data = data.to_vec();
                if corrupt {
                    self.corrupt_in_place(&mut data);
                }
                Some(Passed {
                    at,
                    duplicate_at,
                    data,
                })
            }
            Verdict::Drop(_) => None,
        }
    }
}

/// A datagram a [`LinkModel`] delivers: its bytes as they arrive, when,
/// and when its copy arrives if it is duplicated.
#[derive(Debug)]
struct Passed {
    at: Instant,
    duplicate_at: Option<Instant>,
    data: Vec<u8>,
}

/// One datagram in flight: due at `at`, `seq` in the order it was
/// scheduled; `copy` if duplication made it.
#[derive(Debug)]
struct Scheduled<T> {
    at: Instant,
    seq: u64,
    copy: bool,
    item: T,
}

impl<T> PartialEq for Scheduled<T> {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl<T> Eq for Scheduled<T> {}

impl<T> PartialOrd for Scheduled<T> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<T> Ord for Scheduled<T> {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// Datagrams in flight, leaving in the order of their delivery instants
/// and, at equal instants, in the order they were scheduled (a min-heap
/// keyed by both). Instants from a model without reordering never
/// decrease, so its datagrams leave in offer order.
#[derive(Debug)]
struct InFlight<T> {
    heap: BinaryHeap<Reverse<Scheduled<T>>>,
    next_seq: u64,
}

impl<T> Default for InFlight<T> {
    fn default() -> Self {
        Self {
            heap: BinaryHeap::new(),
            next_seq: 0,
        }
    }
}

impl<T> InFlight<T> {
    fn push(&mut self, at: Instant, copy: bool, item: T) {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.heap.push(Reverse(Scheduled {
            at,
            seq,
            copy,
            item,
        }));
    }

    /// Schedules what `passed` says: the datagram, then its copy if any,
    /// each wrapped by `item`.
    fn schedule(&mut self, passed: Passed, item: impl Fn(Vec<u8>) -> T) {
        match passed.duplicate_at {
            Some(copy_at) => {
                self.push(passed.at, false, item(passed.data.clone()));
                self.push(copy_at, true, item(passed.data));
            }
            None => self.push(passed.at, false, item(passed.data)),
        }
    }

    /// The instant the next datagram is due.
    fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse(d)| d.at)
    }

    /// The next datagram if it is due at `now`.
    fn pop_due(&mut self, now: Instant) -> Option<Scheduled<T>> {
        if self.next_due().is_some_and(|at| at <= now) {
            self.heap.pop().map(|Reverse(d)| d)
        } else {
            None
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at.into()).await,
        None => std::future::pending().await,
    }
}

/// Counters of both relay directions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayStats {
    /// Client → forward address.
    pub up: LinkStats,
    /// Forward address → client.
    pub down: LinkStats,
}

/// A running UDP relay (see [`spawn_relay`]). Stops when dropped.
#[derive(Debug)]
pub struct Relay {
    local_addr: SocketAddr,
    up: Arc<Mutex<LinkModel>>,
    down: Arc<Mutex<LinkModel>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Relay {
    /// Address clients send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Counters of both directions.
    pub fn stats(&self) -> RelayStats {
        RelayStats {
            up: lock(&self.up).stats(),
            down: lock(&self.down).stats(),
        }
    }

    /// Cuts the link in both directions (`true`) or restores it (`false`).
    /// From the moment it is cut until it is restored nothing reaches
    /// either side: every datagram received is dropped, and so is every
    /// datagram already in flight that falls due meanwhile (all counted in
    /// [`LinkStats::dropped_cut`]). In-flight datagrams due after the
    /// restore are delivered. Cutting a cut link (or restoring a working
    /// one) changes nothing.
    pub fn set_cut(&self, cut: bool) {
        lock(&self.up).set_cut(cut);
        lock(&self.down).set_cut(cut);
    }

    /// Whether the link is cut ([`Relay::set_cut`]).
    pub fn is_cut(&self) -> bool {
        lock(&self.up).is_cut()
    }

    /// Stop relaying and wait until both sockets are closed. Datagrams still
    /// in flight are discarded.
    pub async fn shutdown(mut self) {
        for task in std::mem::take(&mut self.tasks) {
            task.abort();
            // The only possible error is the cancellation we just requested.
            let _ = task.await;
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Start a UDP relay listening on `listen`. Datagrams from a client pass the
/// `up` link and are sent to `forward` from a socket of that client's own
/// (bound to any port, made at its first datagram), so several clients (a
/// source whose link has several connections, each on its own socket) can
/// share the relay; datagrams from `forward` to that socket pass the `down`
/// link and go back to that client. Both directions are one link each,
/// shared by all clients. Each direction sends its datagrams at the
/// instants its model hands out, in that order (so
/// [`LinkParams::reorder`] with jitter reorders them), copies made by
/// [`LinkParams::duplicate`] included. Socket buffers are raised to 64 MiB
/// (forced past the sysctl limit when the process has `CAP_NET_ADMIN`).
/// Must be called inside a Tokio runtime.
///
/// # Errors
/// Creating or binding the listening UDP socket (e.g. `listen` in use).
/// A client whose forwarding socket cannot be made is logged and dropped.
pub async fn spawn_relay(
    listen: SocketAddr,
    forward: SocketAddr,
    up: LinkParams,
    down: LinkParams,
) -> io::Result<Relay> {
    let client_side = Arc::new(udp_socket(listen)?);
    let any: IpAddr = match forward {
        SocketAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        SocketAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let local_addr = client_side.local_addr()?;
    let up = Arc::new(Mutex::new(LinkModel::new(up)));
    let down = Arc::new(Mutex::new(LinkModel::new(down)));
    // Per client: its socket towards `forward` and the task pumping the
    // answers back (stopped with the relay, which drops this map).
    let mut clients: HashMap<SocketAddr, (Arc<UdpSocket>, AbortOnDrop)> = HashMap::new();
    let (cs, dn) = (Arc::clone(&client_side), Arc::clone(&down));
    let up_task = tokio::spawn(pump(
        Arc::clone(&client_side),
        Arc::clone(&up),
        move |from| {
            if let Some((sock, _)) = clients.get(&from) {
                return Some((Arc::clone(sock), forward));
            }
            let sock = match udp_socket(SocketAddr::new(any, 0)) {
                Ok(s) => Arc::new(s),
                Err(err) => {
                    tracing::warn!(%err, client = %from, "link-emu relay: no socket for a new client");
                    return None;
                }
            };
            let back = Arc::clone(&cs);
            let task = tokio::spawn(pump(Arc::clone(&sock), Arc::clone(&dn), move |src| {
                (src == forward).then(|| (Arc::clone(&back), from))
            }));
            clients.insert(from, (Arc::clone(&sock), AbortOnDrop(task.abort_handle())));
            Some((sock, forward))
        },
    ));
    Ok(Relay {
        local_addr,
        up,
        down,
        tasks: vec![up_task],
    })
}

fn udp_socket(bind: SocketAddr) -> io::Result<UdpSocket> {
    let socket = Socket::new(Domain::for_address(bind), Type::DGRAM, Some(Protocol::UDP))?;
    if !force_buffers(&socket) {
        // Best effort: the kernel silently clamps to net.core.{r,w}mem_max.
        let _ = socket.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
        let _ = socket.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    }
    socket.set_nonblocking(true)?;
    socket.bind(&bind.into())?;
    UdpSocket::from_std(socket.into())
}

/// Try SO_RCVBUFFORCE / SO_SNDBUFFORCE (needs `CAP_NET_ADMIN`).
#[cfg(any(target_os = "linux", target_os = "android"))]
fn force_buffers(socket: &Socket) -> bool {
    use nix::sys::socket::{setsockopt, sockopt};
    setsockopt(socket, sockopt::RcvBufForce, &SOCKET_BUFFER_BYTES).is_ok()
        && setsockopt(socket, sockopt::SndBufForce, &SOCKET_BUFFER_BYTES).is_ok()
}

#[cfg(not(any(target_os = "linux", target_os = "android")))]
fn force_buffers(_socket: &Socket) -> bool {
    false
}

/// One relay direction: receive on `rx`, run `model`, send on `tx` when due,
/// in the order of the delivery instants; datagrams due while the link is
/// cut are discarded. `route` maps a sender address to the destination
/// (`None` discards) and the socket to send from.
async fn pump<F>(rx: Arc<UdpSocket>, model: Arc<Mutex<LinkModel>>, mut route: F)
where
    F: FnMut(SocketAddr) -> Option<(Arc<UdpSocket>, SocketAddr)>,
{
    let mut buf = vec![0u8; MAX_DATAGRAM_BYTES];
    let mut in_flight: InFlight<(Arc<UdpSocket>, SocketAddr, Vec<u8>)> = InFlight::default();
    loop {
        let head = in_flight.next_due();
        tokio::select! {
            received = rx.recv_from(&mut buf) => match received {
                Ok((len, from)) => {
                    let Some((tx, dest)) = route(from) else { continue };
                    if let Some(passed) = lock(&model).pass(Instant::now(), &buf[..len]) {
                        in_flight.schedule(passed, |data| (Arc::clone(&tx), dest, data));
                    }
                }
                Err(err) => tracing::debug!(%err, "link-emu relay: receive failed"),
            },
            () = sleep_until_opt(head) => {
                let now = Instant::now();
                while let Some(d) = in_flight.pop_due(now) {
                    let (tx, dest, data) = d.item;
                    {
                        let mut model = lock(&model);
                        if model.is_cut() {
                            model.discarded_in_flight(data.len() as u64, d.copy);
                            continue;
                        }
                    }
                    if let Err(err) = tx.send_to(&data, dest).await {
                        tracing::debug!(%err, %dest, "link-emu relay: send failed");
                    }
                }
            }
        }
    }
}

/// A datagram inside the in-memory path.
#[derive(Debug, Clone)]
struct Datagram {
    from: SocketAddr,
    to: SocketAddr,
    ecn: Option<EcnCodepoint>,
    data: Vec<u8>,
}

/// One direction of the in-memory path: the model and datagrams in flight.
#[derive(Debug)]
struct Pipe {
    state: Mutex<(LinkModel, InFlight<Datagram>)>,
    /// Signalled when the next datagram due changes to an earlier one (the
    /// queue was empty, or a datagram overtook the head).
    wake_delivery: Notify,
}

#[derive(Debug, Default)]
struct Inbox {
    queue: VecDeque<Datagram>,
    waker: Option<Waker>,
}

/// The sockets of one side of an in-memory link, by address.
#[derive(Debug, Default)]
struct Side {
    inboxes: Mutex<HashMap<SocketAddr, Weak<Mutex<Inbox>>>>,
}

/// Stops a task when dropped (a delivery task when the last socket
/// sending into its pipe goes; a relay client's answer pump with the
/// relay).
#[derive(Debug)]
struct AbortOnDrop(AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// One end of an in-memory emulated link; implements
/// [`quinn::AsyncUdpSocket`]. Datagrams addressed to anything but a socket
/// of the other side are discarded. No GSO/GRO: one datagram per transmit
/// and receive. Datagrams reach the peer in the order of their delivery
/// instants, duplicates included; this path has no cut (see
/// [`Relay::set_cut`]). More sockets on the same side
/// ([`MemorySocket::sibling`]) share its direction of the link (one
/// bottleneck), as several UDP sockets of one host share its uplink.
#[derive(Debug)]
pub struct MemorySocket {
    addr: SocketAddr,
    /// The sockets of this side (this one included).
    side: Arc<Side>,
    /// The sockets of the other side.
    peers: Weak<Side>,
    out: Arc<Pipe>,
    inbox: Arc<Mutex<Inbox>>,
    delivery: Arc<AbortOnDrop>,
}

impl MemorySocket {
    /// Counters of the direction from this side to the other.
    pub fn stats(&self) -> LinkStats {
        lock(&self.out.state).0.stats()
    }

    /// Another socket on this side of the link, with address `addr`: its
    /// datagrams share this side's direction of the link (rate, queue,
    /// delay, loss) and the other side's sockets can answer it.
    ///
    /// # Errors
    /// [`io::ErrorKind::AddrInUse`] if a socket of this side already has
    /// `addr`.
    pub fn sibling(&self, addr: SocketAddr) -> io::Result<Arc<MemorySocket>> {
        let inbox = Arc::new(Mutex::new(Inbox::default()));
        {
            let mut m = lock(&self.side.inboxes);
            if m.get(&addr).is_some_and(|w| w.strong_count() > 0) {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("in-memory link: {addr} is taken"),
                ));
            }
            m.insert(addr, Arc::downgrade(&inbox));
        }
        Ok(Arc::new(MemorySocket {
            addr,
            side: Arc::clone(&self.side),
            peers: Weak::clone(&self.peers),
            out: Arc::clone(&self.out),
            inbox,
            delivery: Arc::clone(&self.delivery),
        }))
    }
}

/// Two connected in-memory sockets with addresses `a` and `b`, joined by a
/// link with parameters `a_to_b` and `b_to_a`. Use with
/// `quinn::Endpoint::new_with_abstract_socket(.., socket, Arc::new(quinn::TokioRuntime))`.
/// Must be called inside a Tokio runtime (it spawns one delivery task per
/// direction, stopped when every socket sending into it is dropped).
pub fn memory_pair(
    a: SocketAddr,
    b: SocketAddr,
    a_to_b: LinkParams,
    b_to_a: LinkParams,
) -> (Arc<MemorySocket>, Arc<MemorySocket>) {
    let side_a = Arc::new(Side::default());
    let side_b = Arc::new(Side::default());
    let end = |addr, params, side: &Arc<Side>, peers: &Arc<Side>| {
        let out = Arc::new(Pipe {
            state: Mutex::new((LinkModel::new(params), InFlight::default())),
            wake_delivery: Notify::new(),
        });
        let delivery =
            tokio::spawn(deliver(Arc::clone(&out), Arc::downgrade(peers))).abort_handle();
        let inbox = Arc::new(Mutex::new(Inbox::default()));
        lock(&side.inboxes).insert(addr, Arc::downgrade(&inbox));
        Arc::new(MemorySocket {
            addr,
            side: Arc::clone(side),
            peers: Arc::downgrade(peers),
            out,
            inbox,
            delivery: Arc::new(AbortOnDrop(delivery)),
        })
    };
    let socket_a = end(a, a_to_b, &side_a, &side_b);
    let socket_b = end(b, b_to_a, &side_b, &side_a);
    (socket_a, socket_b)
}

/// Move due datagrams from `pipe` to the inboxes of `side` (by
/// destination), sleeping until the next is due. Exits when every socket
/// of the receiving side is dropped.
async fn deliver(pipe: Arc<Pipe>, side: Weak<Side>) {
    while let Some(side) = side.upgrade() {
        let now = Instant::now();
        let (wakers, next) = {
            let mut state = lock(&pipe.state);
            let inboxes = lock(&side.inboxes);
            let mut wakers = Vec::new();
            while let Some(d) = state.1.pop_due(now) {
                let Some(inbox) = inboxes.get(&d.item.to).and_then(Weak::upgrade) else {
                    continue;
                };
                let mut inbox = lock(&inbox);
                inbox.queue.push_back(d.item);
                if let Some(w) = inbox.waker.take() {
                    wakers.push(w);
                }
            }
            (wakers, state.1.next_due())
        };
        drop(side);
        for waker in wakers {
            waker.wake();
        }
        match next {
            Some(at) => tokio::select! {
                () = tokio::time::sleep_until(at.into()) => {}
                () = pipe.wake_delivery.notified() => {}
            },
            None => pipe.wake_delivery.notified().await,
        }
    }
}

/// The in-memory path never blocks senders (a full queue tail-drops).
#[derive(Debug)]
struct AlwaysWritable;

impl UdpPoller for AlwaysWritable {
    fn poll_writable(self: Pin<&mut Self>, _cx: &mut Context) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl AsyncUdpSocket for MemorySocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        Box::pin(AlwaysWritable)
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        let known = self
            .peers
            .upgrade()
            .is_some_and(|p| lock(&p.inboxes).contains_key(&transmit.destination));
        if !known {
            return Ok(());
        }
        let segment = transmit
            .segment_size
            .unwrap_or(transmit.contents.len())
            .max(1);
        let now = Instant::now();
        let mut state = lock(&self.out.state);
        let (model, in_flight) = &mut *state;
        let head = in_flight.next_due();
        for chunk in transmit.contents.chunks(segment) {
            if let Some(passed) = model.pass(now, chunk) {
                in_flight.schedule(passed, |data| Datagram {
                    from: self.addr,
                    to: transmit.destination,
                    ecn: transmit.ecn,
                    data,
                });
            }
        }
        let notify = match (head, in_flight.next_due()) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(before), Some(now)) => now < before,
        };
        drop(state);
        if notify {
            self.out.wake_delivery.notify_one();
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        let mut inbox = lock(&self.inbox);
        if inbox.queue.is_empty() {
            inbox.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let mut filled = 0;
        for (buf, meta) in bufs.iter_mut().zip(meta.iter_mut()) {
            let Some(datagram) = inbox.queue.pop_front() else {
                break;
            };
            let len = datagram.data.len().min(buf.len());
            buf[..len].copy_from_slice(&datagram.data[..len]);
            *meta = RecvMeta {
                addr: datagram.from,
                len,
                stride: len,
                ecn: datagram.ecn,
                dst_ip: Some(self.addr.ip()),
            };
            filled += 1;
        }
        Poll::Ready(Ok(filled))
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.addr)
    }

    fn max_transmit_segments(&self) -> usize {
        1
    }

    fn may_fragment(&self) -> bool {
        false
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    const MBIT: u64 = 1_000_000;

    /// 8 Mbit/s = 1 byte/µs; 972-byte payloads are 1000 wire bytes = 1 ms.
    fn params(queue_bytes: u64) -> LinkParams {
        LinkParams {
            queue_bytes,
            ..LinkParams::new(8 * MBIT, Duration::from_millis(20))
        }
    }

    fn at(verdict: Verdict) -> Instant {
        match verdict {
            Verdict::Deliver { at, .. } => at,
            Verdict::Drop(reason) => panic!("unexpected drop: {reason:?}"),
        }
    }

    #[test]
    fn new_uses_bdp_queue_and_half_rtt() {
        let p = LinkParams::new(100 * MBIT, Duration::from_millis(20));
        assert_eq!(p.queue_bytes, 250_000);
        assert_eq!(p.one_way_delay, Duration::from_millis(10));
        assert_eq!((p.loss, p.corrupt), (0.0, 0.0));
    }

    #[test]
    fn burst_is_spaced_by_serialisation_time_plus_delay() {
        let mut m = LinkModel::new(params(1 << 20));
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        for i in 1..=50u32 {
            assert_eq!(at(m.offer(t0, 972)), t0 + 10 * ms + i * ms);
        }
        assert_eq!(m.backlog_bytes(t0), 50_000);
        assert_eq!(m.backlog_bytes(t0 + Duration::from_micros(20_500)), 29_500);
        // Long after, the link is idle again: serialisation + delay only.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(at(m.offer(t1, 972)), t1 + ms + 10 * ms);
    }

    #[test]
    fn long_run_rate_equals_cap_without_drift() {
        // 100 Mbit/s, 1500-byte wire packets offered at twice the rate for
        // 10 simulated seconds: the link never idles, so the last delivery
        // must be exactly (delivered bits / rate) after the start.
        let p = LinkParams::new(100 * MBIT, Duration::from_millis(20));
        let mut m = LinkModel::new(p.clone());
        let t0 = Instant::now();
        let mut last = t0;
        let mut wire_bits: u128 = 0;
        for i in 0..166_666u32 {
            if let Verdict::Deliver { at, .. } = m.offer(t0 + Duration::from_micros(60) * i, 1472) {
                last = at;
                wire_bits += 1500 * 8;
            }
        }
        let busy = last - p.one_way_delay - t0;
        let exact = (wire_bits * NANOS_PER_SEC).div_ceil(u128::from(p.rate_bps));
        assert_eq!(busy.as_nanos(), exact);
        let rate = wire_bits as f64 / busy.as_secs_f64();
        assert!((rate / p.rate_bps as f64 - 1.0).abs() < 1e-6, "rate {rate}");
        let stats = m.stats();
        assert!(stats.dropped_queue > 70_000, "{stats:?}");
        assert_eq!(stats.delivered_packets as u128 * 1500 * 8, wire_bits);
    }

    #[test]
    fn queue_tail_drops_then_accepts_after_draining() {
        let mut m = LinkModel::new(params(10_000));
        let t0 = Instant::now();
        for _ in 0..10 {
            at(m.offer(t0, 972));
        }
        assert_eq!(m.offer(t0, 972), Verdict::Drop(DropReason::QueueFull));
        assert_eq!(m.offer(t0, 972), Verdict::Drop(DropReason::QueueFull));
        // One packet serialised after 1 ms: room for exactly one more.
        let t1 = t0 + Duration::from_millis(1);
        let last = at(m.offer(t1, 972));
        assert_eq!(last, t0 + Duration::from_millis(21));
        assert_eq!(m.offer(t1, 972), Verdict::Drop(DropReason::QueueFull));
        // Fully drained: accepted again without queueing delay.
        let t2 = t0 + Duration::from_millis(11);
        assert_eq!(m.backlog_bytes(t2), 0);
        assert_eq!(at(m.offer(t2, 972)), t2 + Duration::from_millis(11));
        let stats = m.stats();
        assert_eq!((stats.delivered_packets, stats.dropped_queue), (12, 3));
        assert_eq!(stats.delivered_bytes, 12 * 972);
    }

    #[test]
    fn jitter_spreads_delay_without_reordering_unless_asked() {
        let ms = Duration::from_millis(1);
        let base = LinkParams {
            jitter: 5 * ms,
            seed: 9,
            ..LinkParams::new(0, Duration::from_millis(40))
        };
        let run = |p: LinkParams| {
            let mut m = LinkModel::new(p);
            let t0 = Instant::now();
            (0..2_000u32)
                .map(|i| {
                    let now = t0 + Duration::from_micros(100) * i;
                    at(m.offer_packet(now, 1500)) - now
                })
                .collect::<Vec<Duration>>()
        };
        // Unlimited rate: the delay is the propagation delay alone.
        let ordered = run(base.clone());
        let (lo, hi) = (ordered.iter().min().unwrap(), ordered.iter().max().unwrap());
        assert!(*lo >= 15 * ms && *hi <= 25 * ms, "{lo:?}..{hi:?}");
        assert!(*hi - *lo > 8 * ms, "jitter not applied: {lo:?}..{hi:?}");
        // Offers are 100 µs apart, so order holds iff each delay is at least
        // the previous one minus 100 µs.
        let inversions = |d: &[Duration]| {
            d.windows(2)
                .filter(|w| w[1] + Duration::from_micros(100) < w[0])
                .count()
        };
        assert_eq!(inversions(&ordered), 0);
        let reordered = run(LinkParams {
            reorder: true,
            ..base
        });
        assert!(inversions(&reordered) > 100, "{}", inversions(&reordered));
        let (lo, hi) = (
            reordered.iter().min().unwrap(),
            reordered.iter().max().unwrap(),
        );
        assert!(*lo >= 15 * ms && *hi <= 25 * ms, "{lo:?}..{hi:?}");
    }

    #[test]
    fn offer_packet_counts_the_whole_packet() {
        // 8 Mbit/s: a 1000-byte IP packet takes 1 ms; no UDP overhead added.
        let mut m = LinkModel::new(params(1 << 20));
        let t0 = Instant::now();
        assert_eq!(at(m.offer_packet(t0, 1000)), t0 + Duration::from_millis(11));
        assert_eq!(m.stats().delivered_bytes, 1000);
    }

    #[test]
    fn random_loss_fraction_and_determinism() {
        let p = LinkParams {
            loss: 0.1,
            seed: 7,
            ..params(1 << 20)
        };
        let run = |p: LinkParams| {
            let mut m = LinkModel::new(p);
            let t0 = Instant::now();
            let verdicts: Vec<bool> = (0..20_000u32)
                .map(|i| {
                    matches!(
                        m.offer(t0 + Duration::from_millis(2) * i, 100),
                        Verdict::Drop(_)
                    )
                })
                .collect();
            (verdicts, m.stats())
        };
        let (drops, stats) = run(p.clone());
        assert_eq!(stats.dropped_queue, 0);
        let fraction = stats.dropped_loss as f64 / 20_000.0;
        assert!((0.08..0.12).contains(&fraction), "loss fraction {fraction}");
        assert_eq!(run(p).0, drops);
    }

    #[test]
    fn deliveries_stay_fifo_and_corruption_flips_one_byte() {
        let mut m = LinkModel::new(LinkParams {
            loss: 0.05,
            corrupt: 0.2,
            seed: 3,
            ..LinkParams::new(10 * MBIT, Duration::from_millis(5))
        });
        let mut rng = StdRng::seed_from_u64(11);
        let mut now = Instant::now();
        let mut prev = now;
        let mut corrupted = 0;
        for _ in 0..10_000 {
            now += Duration::from_micros(rng.gen_range(0..2_000));
            // An occasional stale timestamp must not reorder deliveries.
            let offered_at = now - Duration::from_micros(rng.gen_range(0..100));
            if let Verdict::Deliver { at, corrupt, .. } =
                m.offer(offered_at, rng.gen_range(0..1400))
            {
                assert!(at >= prev);
                prev = at;
                corrupted += u64::from(corrupt);
            }
        }
        assert_eq!(m.stats().corrupted, corrupted);
        assert!(corrupted > 0);
        let original = vec![0x5a; 64];
        let mut datagram = original.clone();
        m.corrupt_in_place(&mut datagram);
        let changed = original
            .iter()
            .zip(&datagram)
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(changed, 1);
    }

    #[tokio::test]
    async fn relay_echo_adds_rtt() {
        let echo = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            while let Ok((n, from)) = echo.recv_from(&mut buf).await {
                let _ = echo.send_to(&buf[..n], from).await;
            }
        });
        let link = LinkParams::new(100 * MBIT, Duration::from_millis(20));
        let relay = spawn_relay(
            "127.0.0.1:0".parse().unwrap(),
            echo_addr,
            link.clone(),
            link,
        )
        .await
        .unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut buf = vec![0u8; 2048];
        for round in 0..3u8 {
            let payload = vec![round; 1200];
            let sent = Instant::now();
            client.send_to(&payload, relay.local_addr()).await.unwrap();
            let (n, from) =
                tokio::time::timeout(Duration::from_secs(10), client.recv_from(&mut buf))
                    .await
                    .unwrap()
                    .unwrap();
            let rtt = sent.elapsed();
            assert_eq!(from, relay.local_addr());
            assert_eq!(&buf[..n], &payload[..]);
            assert!(rtt >= Duration::from_millis(20), "rtt {rtt:?}");
        }
        let stats = relay.stats();
        assert_eq!(
            (stats.up.delivered_packets, stats.down.delivered_packets),
            (3, 3)
        );
        assert_eq!(stats.up.delivered_bytes, 3 * 1200);
        relay.shutdown().await;
    }

    #[tokio::test]
    async fn relay_keeps_clients_apart() {
        // An echo server that also says which address it saw.
        let echo = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            while let Ok((n, from)) = echo.recv_from(&mut buf).await {
                let mut out = buf[..n].to_vec();
                out.extend_from_slice(from.to_string().as_bytes());
                let _ = echo.send_to(&out, from).await;
            }
        });
        let link = LinkParams::new(100 * MBIT, Duration::from_millis(10));
        let relay = spawn_relay(
            "127.0.0.1:0".parse().unwrap(),
            echo_addr,
            link.clone(),
            link,
        )
        .await
        .unwrap();
        let a = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let b = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let mut seen_by_server = Vec::new();
        for round in 0..3u8 {
            for (i, c) in [&a, &b].into_iter().enumerate() {
                let tag = [b'a' + i as u8, round];
                c.send_to(&tag, relay.local_addr()).await.unwrap();
            }
            for (i, c) in [&a, &b].into_iter().enumerate() {
                let mut buf = vec![0u8; 2048];
                let (n, from) =
                    tokio::time::timeout(Duration::from_secs(10), c.recv_from(&mut buf))
                        .await
                        .unwrap()
                        .unwrap();
                assert_eq!(from, relay.local_addr());
                // Each client gets its own answer, never the other's.
                assert_eq!(&buf[..2], &[b'a' + i as u8, round]);
                seen_by_server.push((i, String::from_utf8(buf[2..n].to_vec()).unwrap()));
            }
        }
        // The server saw one address per client, a different one each.
        let a_addrs: HashSet<_> = seen_by_server
            .iter()
            .filter(|s| s.0 == 0)
            .map(|s| &s.1)
            .collect();
        let b_addrs: HashSet<_> = seen_by_server
            .iter()
            .filter(|s| s.0 == 1)
            .map(|s| &s.1)
            .collect();
        assert_eq!((a_addrs.len(), b_addrs.len()), (1, 1));
        assert!(a_addrs.is_disjoint(&b_addrs));
        // One link per direction, shared.
        let stats = relay.stats();
        assert_eq!(
            (stats.up.delivered_packets, stats.down.delivered_packets),
            (6, 6)
        );
        relay.shutdown().await;
    }

    #[test]
    fn duplicates_follow_the_probability_and_arrive_right_after() {
        // 972-byte payloads are 1 ms on the wire, offered every 3 ms: the
        // link idles between offers, so only duplication adds to it.
        let ms = Duration::from_millis(1);
        let p = LinkParams {
            duplicate: 0.03,
            seed: 13,
            ..params(1 << 20)
        };
        let run = |p: LinkParams| {
            let mut m = LinkModel::new(p);
            let t0 = Instant::now();
            let mut copied = Vec::new();
            for i in 0..20_000u32 {
                let now = t0 + 3 * ms * i;
                let Verdict::Deliver {
                    at, duplicate_at, ..
                } = m.offer(now, 972)
                else {
                    panic!("datagram {i} dropped");
                };
                assert_eq!(at, now + 11 * ms);
                if let Some(copy) = duplicate_at {
                    // Serialised right after the original, same delay.
                    assert_eq!(copy, at + ms);
                }
                copied.push(duplicate_at.is_some());
            }
            (copied, m.stats())
        };
        let (copied, stats) = run(p.clone());
        let copies = copied.iter().filter(|c| **c).count() as u64;
        assert_eq!(stats.duplicated, copies);
        assert_eq!(stats.delivered_packets, 20_000 + copies);
        assert_eq!(stats.delivered_bytes, (20_000 + copies) * 972);
        assert_eq!((stats.dropped_queue, stats.dropped_loss), (0, 0));
        let fraction = copies as f64 / 20_000.0;
        assert!((0.025..0.035).contains(&fraction), "duplicated {fraction}");
        // Same seed, same decisions.
        assert_eq!(run(p).0, copied);
    }

    #[test]
    fn a_copy_takes_capacity_and_queue_room() {
        // Every datagram duplicated; the queue holds three 1000-byte
        // datagrams (1 ms each on the wire).
        let ms = Duration::from_millis(1);
        let mut m = LinkModel::new(LinkParams {
            duplicate: 1.0,
            ..params(3_000)
        });
        let t0 = Instant::now();
        let deliver = |v: Verdict| match v {
            Verdict::Deliver {
                at, duplicate_at, ..
            } => (at, duplicate_at),
            Verdict::Drop(reason) => panic!("unexpected drop: {reason:?}"),
        };
        assert_eq!(
            deliver(m.offer(t0, 972)),
            (t0 + 11 * ms, Some(t0 + 12 * ms))
        );
        // The next one waits behind the copy; its own copy finds the
        // queue full and is tail-dropped.
        assert_eq!(deliver(m.offer(t0, 972)), (t0 + 13 * ms, None));
        assert_eq!(m.offer(t0, 972), Verdict::Drop(DropReason::QueueFull));
        let s = m.stats();
        assert_eq!(
            (s.delivered_packets, s.duplicated, s.dropped_queue),
            (3, 1, 2)
        );
        assert_eq!(s.delivered_bytes, 3 * 972);
    }

    #[test]
    fn without_reorder_nothing_is_reordered_duplicates_included() {
        let ms = Duration::from_millis(1);
        let base = LinkParams {
            jitter: 5 * ms,
            duplicate: 0.2,
            seed: 21,
            ..LinkParams::new(100 * MBIT, Duration::from_millis(40))
        };
        let run = |p: LinkParams| {
            let mut m = LinkModel::new(p);
            let t0 = Instant::now();
            let mut instants = Vec::new();
            for i in 0..5_000u32 {
                let now = t0 + Duration::from_micros(200) * i;
                if let Verdict::Deliver {
                    at, duplicate_at, ..
                } = m.offer(now, 1200)
                {
                    instants.push(at);
                    instants.extend(duplicate_at);
                }
            }
            (instants, m.stats())
        };
        let inversions = |d: &[Instant]| d.windows(2).filter(|w| w[1] < w[0]).count();
        let (ordered, stats) = run(base.clone());
        assert_eq!(inversions(&ordered), 0);
        assert_eq!(stats.reordered, 0);
        assert!(stats.duplicated > 800, "{stats:?}");
        let (shuffled, stats) = run(LinkParams {
            reorder: true,
            ..base
        });
        let inverted = inversions(&shuffled);
        assert!(inverted > 100, "{inverted} inversions");
        // Each datagram arriving before its predecessor overtook it.
        assert!(stats.reordered >= inverted as u64, "{stats:?}");
    }

    #[test]
    fn a_cut_link_drops_everything_until_restored() {
        let ms = Duration::from_millis(1);
        let p = LinkParams {
            loss: 0.2,
            duplicate: 0.2,
            seed: 17,
            ..params(1 << 20)
        };
        let mut m = LinkModel::new(p.clone());
        let mut twin = LinkModel::new(p);
        let t0 = Instant::now();
        let outcome = |v: Verdict| match v {
            Verdict::Deliver { duplicate_at, .. } => Some(duplicate_at.is_some()),
            Verdict::Drop(DropReason::Loss) => None,
            Verdict::Drop(reason) => panic!("unexpected drop: {reason:?}"),
        };
        let mut expected = Vec::new();
        let mut seen = Vec::new();
        for i in 0..100u32 {
            let now = t0 + 10 * ms * i;
            expected.push(outcome(twin.offer(now, 972)));
            seen.push(outcome(m.offer(now, 972)));
        }
        let before = m.stats();
        let backlog = m.backlog_bytes(t0 + 990 * ms);
        m.set_cut(true);
        assert!(m.is_cut());
        for i in 0..500u32 {
            let now = t0 + 990 * ms + Duration::from_micros(10) * i;
            assert_eq!(m.offer(now, 972), Verdict::Drop(DropReason::Cut));
        }
        let during = m.stats();
        assert_eq!(during.dropped_cut, 500);
        assert_eq!(
            LinkStats {
                dropped_cut: 0,
                ..during
            },
            before,
            "a cut link delivers, loses and duplicates nothing"
        );
        // Dropped at the cut: no capacity used.
        assert_eq!(m.backlog_bytes(t0 + 990 * ms), backlog);
        m.set_cut(false);
        assert!(!m.is_cut());
        // Restored: delivering again, with the decisions a link that was
        // never cut makes (a cut draws no random numbers).
        for i in 100..200u32 {
            let now = t0 + 10 * ms * i;
            expected.push(outcome(twin.offer(now, 972)));
            seen.push(outcome(m.offer(now, 972)));
        }
        assert_eq!(seen, expected);
        assert!(m.stats().delivered_packets > during.delivered_packets);
        assert_eq!(m.stats().dropped_cut, 500);
    }

    /// Sends `n` numbered datagrams through a relay whose up link is
    /// `link`, ten at a time, and returns the numbers in the order they
    /// arrived (waiting at most 10 s for each) and the relay's counters.
    async fn relay_order(link: LinkParams, n: u32) -> (Vec<u32>, RelayStats) {
        let server = udp_socket("127.0.0.1:0".parse().unwrap()).unwrap();
        let relay = spawn_relay(
            "127.0.0.1:0".parse().unwrap(),
            server.local_addr().unwrap(),
            link,
            LinkParams::new(0, Duration::ZERO),
        )
        .await
        .unwrap();
        let receiver = tokio::spawn(async move {
            let mut got = Vec::new();
            let mut buf = [0u8; 64];
            while got.len() < n as usize {
                let wait = Duration::from_secs(10);
                match tokio::time::timeout(wait, server.recv_from(&mut buf)).await {
                    Ok(Ok((4, _))) => {
                        got.push(u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]))
                    }
                    Ok(other) => panic!("unexpected receive: {other:?}"),
                    Err(_) => break,
                }
            }
            got
        });
        let client = udp_socket("127.0.0.1:0".parse().unwrap()).unwrap();
        for i in 0..n {
            client
                .send_to(&i.to_be_bytes(), relay.local_addr())
                .await
                .unwrap();
            if i % 10 == 9 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let got = receiver.await.unwrap();
        let stats = relay.stats();
        relay.shutdown().await;
        (got, stats)
    }

    #[tokio::test]
    async fn relay_reorders_with_jitter_only_when_asked() {
        // Unlimited rate, 10 ms +- 8 ms one way.
        let link = LinkParams {
            jitter: Duration::from_millis(8),
            seed: 3,
            ..LinkParams::new(0, Duration::from_millis(20))
        };
        let all: Vec<u32> = (0..300).collect();
        let (got, stats) = relay_order(link.clone(), 300).await;
        assert_eq!(got, all, "reorder = false: offer order, nothing lost");
        assert_eq!(stats.up.reordered, 0);
        let (got, stats) = relay_order(
            LinkParams {
                reorder: true,
                ..link
            },
            300,
        )
        .await;
        let mut sorted = got.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, all, "reorder = true: every datagram once");
        let late = got.windows(2).filter(|w| w[1] < w[0]).count();
        assert!(late >= 10, "only {late} arrived after a later one: {got:?}");
        assert!(stats.up.reordered > 0, "{stats:?}");
    }

    #[tokio::test]
    async fn relay_delivers_duplicates() {
        let link = LinkParams {
            duplicate: 1.0,
            ..LinkParams::new(0, Duration::from_millis(2))
        };
        let (got, stats) = relay_order(link, 40).await;
        // The receiver stops after 40 datagrams: the first 20, each twice.
        let twice: Vec<u32> = (0..20).flat_map(|i| [i, i]).collect();
        assert_eq!(got, twice);
        assert!(stats.up.duplicated >= 20, "{stats:?}");
    }

    #[tokio::test]
    async fn relay_cut_drops_both_directions_and_what_is_in_flight() {
        async fn recv(sock: &UdpSocket) -> (Vec<u8>, SocketAddr) {
            let mut buf = [0u8; 64];
            let (n, from) = tokio::time::timeout(Duration::from_secs(10), sock.recv_from(&mut buf))
                .await
                .expect("nothing received within 10 s")
                .unwrap();
            (buf[..n].to_vec(), from)
        }
        async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !cond() {
                assert!(Instant::now() < deadline, "timed out waiting for {what}");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let server = udp_socket("127.0.0.1:0".parse().unwrap()).unwrap();
        // Up: 1 s one way, so a datagram is still in flight when the cut
        // comes; down: 5 ms.
        let relay = spawn_relay(
            "127.0.0.1:0".parse().unwrap(),
            server.local_addr().unwrap(),
            LinkParams::new(0, Duration::from_secs(2)),
            LinkParams::new(0, Duration::from_millis(10)),
        )
        .await
        .unwrap();
        let client = udp_socket("127.0.0.1:0".parse().unwrap()).unwrap();
        let to_relay = relay.local_addr();
        client.send_to(b"hello", to_relay).await.unwrap();
        let (got, relay_out) = recv(&server).await;
        assert_eq!(got, b"hello");
        server.send_to(b"hi", relay_out).await.unwrap();
        assert_eq!(recv(&client).await, (b"hi".to_vec(), to_relay));

        client.send_to(b"in flight", to_relay).await.unwrap();
        wait_for("the relay to accept it", || {
            relay.stats().up.delivered_packets == 2
        })
        .await;
        relay.set_cut(true);
        assert!(relay.is_cut());
        wait_for("the datagram in flight to fall due", || {
            relay.stats().up.dropped_cut == 1
        })
        .await;
        for _ in 0..5 {
            client.send_to(b"lost up", to_relay).await.unwrap();
            server.send_to(b"lost down", relay_out).await.unwrap();
        }
        wait_for("the relay to drop 5 datagrams each way", || {
            let s = relay.stats();
            (s.up.dropped_cut, s.down.dropped_cut) == (6, 5)
        })
        .await;
        // Dropped on arrival: nothing is in flight, nothing arrived.
        let mut buf = [0u8; 64];
        for sock in [&client, &server] {
            let e = sock.try_recv_from(&mut buf).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        }

        relay.set_cut(false);
        assert!(!relay.is_cut());
        client.send_to(b"back", to_relay).await.unwrap();
        assert_eq!(recv(&server).await, (b"back".to_vec(), relay_out));
        server.send_to(b"welcome back", relay_out).await.unwrap();
        assert_eq!(recv(&client).await, (b"welcome back".to_vec(), to_relay));
        let s = relay.stats();
        assert_eq!((s.up.delivered_packets, s.up.dropped_cut), (2, 6), "{s:?}");
        assert_eq!(
            (s.down.delivered_packets, s.down.dropped_cut),
            (2, 5),
            "{s:?}"
        );
        relay.shutdown().await;
    }

    /// Send `len` bytes on a uni stream from `a` to `b` over an in-memory
    /// link and return what `b` received.
    async fn quic_transfer(link: LinkParams, len: usize) -> (Vec<u8>, Vec<u8>, LinkStats) {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let cert_der = cert.cert.der().clone();
        let key = rustls::pki_types::PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der());
        let server_config =
            quinn::ServerConfig::with_single_cert(vec![cert_der.clone()], key.into()).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert_der).unwrap();
        let client_config = quinn::ClientConfig::with_root_certificates(Arc::new(roots)).unwrap();

        let (a_addr, b_addr) = (
            "10.0.0.1:4000".parse().unwrap(),
            "10.0.0.2:4433".parse().unwrap(),
        );
        let (a, b) = memory_pair(a_addr, b_addr, link.clone(), link);
        let runtime = Arc::new(quinn::TokioRuntime);
        let server = quinn::Endpoint::new_with_abstract_socket(
            Default::default(),
            Some(server_config),
            b,
            runtime.clone(),
        )
        .unwrap();
        let mut client =
            quinn::Endpoint::new_with_abstract_socket(Default::default(), None, a.clone(), runtime)
                .unwrap();
        client.set_default_client_config(client_config);

        let payload: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        let receiver = tokio::spawn(async move {
            // A corrupted first Initial fails to authenticate; the client retries.
            let conn = loop {
                if let Ok(conn) = server.accept().await.unwrap().await {
                    break conn;
                }
            };
            let mut stream = conn.accept_uni().await.unwrap();
            let data = stream.read_to_end(usize::MAX).await.unwrap();
            conn.close(0u32.into(), b"done");
            server.wait_idle().await;
            data
        });
        let conn = client.connect(b_addr, "localhost").unwrap().await.unwrap();
        let mut stream = conn.open_uni().await.unwrap();
        stream.write_all(&payload).await.unwrap();
        stream.finish().unwrap();
        conn.closed().await;
        let received = receiver.await.unwrap();
        (payload, received, a.stats())
    }

    #[tokio::test]
    async fn quinn_over_memory_pair_transfers_intact() {
        let link = LinkParams::new(100 * MBIT, Duration::from_millis(20));
        let run = quic_transfer(link, 2 << 20);
        let (sent, received, stats) = tokio::time::timeout(Duration::from_secs(120), run)
            .await
            .unwrap();
        assert!(received == sent, "payload mismatch");
        assert!(stats.delivered_bytes > 2 << 20, "{stats:?}");
    }

    #[tokio::test]
    async fn quinn_over_lossy_corrupting_link_transfers_intact() {
        let link = LinkParams {
            loss: 0.01,
            corrupt: 0.01,
            seed: 5,
            ..LinkParams::new(100 * MBIT, Duration::from_millis(20))
        };
        let run = quic_transfer(link, 1 << 20);
        let (sent, received, stats) = tokio::time::timeout(Duration::from_secs(120), run)
            .await
            .unwrap();
        assert!(received == sent, "payload mismatch");
        assert!(stats.dropped_loss > 0 && stats.corrupted > 0, "{stats:?}");
    }

    #[tokio::test]
    async fn quinn_over_reordering_duplicating_link_transfers_intact() {
        let link = LinkParams {
            jitter: Duration::from_millis(3),
            reorder: true,
            duplicate: 0.03,
            seed: 8,
            ..LinkParams::new(100 * MBIT, Duration::from_millis(20))
        };
        let run = quic_transfer(link, 1 << 20);
        let (sent, received, stats) = tokio::time::timeout(Duration::from_secs(120), run)
            .await
            .unwrap();
        assert!(received == sent, "payload mismatch");
        assert!(stats.duplicated > 0 && stats.reordered > 0, "{stats:?}");
    }

    #[tokio::test]
    async fn siblings_share_the_link_and_get_their_own_answers() {
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let cert_der = cert.cert.der().clone();
        let key = rustls::pki_types::PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der());
        let server_config =
            quinn::ServerConfig::with_single_cert(vec![cert_der.clone()], key.into()).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert_der).unwrap();
        let client_config = quinn::ClientConfig::with_root_certificates(Arc::new(roots)).unwrap();
        let (a_addr, b_addr): (SocketAddr, SocketAddr) = (
            "10.0.0.1:4000".parse().unwrap(),
            "10.0.0.2:4433".parse().unwrap(),
        );
        let link = LinkParams::new(100 * MBIT, Duration::from_millis(10));
        let (a, b) = memory_pair(a_addr, b_addr, link.clone(), link);
        let a2 = a.sibling("10.0.0.1:4001".parse().unwrap()).unwrap();
        assert!(a.sibling(a_addr).is_err(), "an address in use is refused");
        let runtime = Arc::new(quinn::TokioRuntime);
        let server = quinn::Endpoint::new_with_abstract_socket(
            Default::default(),
            Some(server_config),
            b,
            runtime.clone(),
        )
        .unwrap();
        let mut clients = Vec::new();
        for s in [a.clone(), a2] {
            let s: Arc<dyn AsyncUdpSocket> = s;
            let mut c = quinn::Endpoint::new_with_abstract_socket(
                Default::default(),
                None,
                s,
                runtime.clone(),
            )
            .unwrap();
            c.set_default_client_config(client_config.clone());
            clients.push(c);
        }
        let receiver = tokio::spawn(async move {
            let mut got = Vec::new();
            for _ in 0..2 {
                let conn = server.accept().await.unwrap().await.unwrap();
                let remote = conn.remote_address();
                let mut stream = conn.accept_uni().await.unwrap();
                got.push((remote, stream.read_to_end(1 << 20).await.unwrap()));
            }
            got.sort();
            got
        });
        let run = async {
            for (i, c) in clients.iter().enumerate() {
                let conn = c.connect(b_addr, "localhost").unwrap().await.unwrap();
                let mut stream = conn.open_uni().await.unwrap();
                stream.write_all(&[i as u8; 1000]).await.unwrap();
                stream.finish().unwrap();
                stream.stopped().await.unwrap();
            }
            receiver.await.unwrap()
        };
        let got = tokio::time::timeout(Duration::from_secs(60), run)
            .await
            .unwrap();
        assert_eq!(got[0], (a_addr, vec![0u8; 1000]));
        assert_eq!(got[1], ("10.0.0.1:4001".parse().unwrap(), vec![1u8; 1000]));
        // Both directions of both connections went through one model.
        assert!(a.stats().delivered_bytes > 2000, "{:?}", a.stats());
    }
}
