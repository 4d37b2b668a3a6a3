//! Link emulation without root privileges.
//!
//! One sans-IO model of a bottleneck link ([`LinkModel`]: rate cap, bounded
//! FIFO queue, propagation delay, random loss and corruption) drives two
//! transports:
//!
//! * [`spawn_relay`]: a UDP relay between real sockets, for separate processes;
//! * [`memory_pair`]: two in-process [`quinn::AsyncUdpSocket`]s joined by an
//!   emulated link, for agents inside one process.
//!
//! Sizes are counted in *wire bytes*: UDP payload length plus
//! [`WIRE_OVERHEAD_BYTES`] (20 bytes IPv4 header + 8 bytes UDP header).

use std::collections::VecDeque;
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
    /// Seed of the random number generator used for loss, corruption and
    /// jitter.
    pub seed: u64,
    /// Jitter: each datagram's propagation delay is `one_way_delay` plus a
    /// uniform offset in `[-jitter, +jitter]` (never below zero), as netem's
    /// uniform jitter. Zero by default.
    pub jitter: Duration,
    /// Whether jitter may reorder datagrams. When `false` (the default) a
    /// datagram is never delivered before the one offered before it, so
    /// jitter only bunches datagrams up (and TCP sees no false reordering).
    pub reorder: bool,
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
        }
    }
}

/// Outcome of offering a datagram to a [`LinkModel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Deliver the datagram at `at`; if `corrupt`, flip one byte first
    /// (see [`LinkModel::corrupt_in_place`]).
    Deliver {
        /// Instant the last bit arrives at the far end.
        at: Instant,
        /// Whether the datagram is to be corrupted.
        corrupt: bool,
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
}

/// Counters of one link direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LinkStats {
    /// Datagrams accepted for delivery.
    pub delivered_packets: u64,
    /// UDP payload bytes accepted for delivery.
    pub delivered_bytes: u64,
    /// Datagrams dropped at random.
    pub dropped_loss: u64,
    /// Datagrams tail-dropped because the queue was full.
    pub dropped_queue: u64,
    /// Delivered datagrams marked for corruption.
    pub corrupted: u64,
}

/// Sans-IO model of one direction of a bottleneck link.
///
/// Random loss is applied first (a lost datagram uses no capacity, like
/// netem). Then the router queue: the backlog is the number of wire bytes not
/// yet serialised at `now`; if backlog + wire bytes exceeds the queue size the
/// datagram is tail-dropped (an idle link always accepts). Otherwise it is
/// delivered at `max(now, busy_until) + wire_bytes * 8 / rate + one_way_delay`.
/// Time is kept as exact integer nanoseconds from the start of the current
/// busy period, so long runs do not drift. Deliveries are in FIFO order
/// unless [`LinkParams::reorder`] lets jitter reorder them (the relay and the
/// in-memory pair deliver in offer order whatever the instants; the TUN
/// emulator in `ops/wanem` honours reordering).
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
            stats: LinkStats::default(),
        }
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
        if self.chance(self.params.loss) {
            self.stats.dropped_loss += 1;
            return Verdict::Drop(DropReason::Loss);
        }
        let backlog = self.backlog_bytes(now);
        let start = match self.period_start {
            Some(start) if backlog > 0 => {
                if backlog.saturating_add(wire) > self.params.queue_bytes {
                    self.stats.dropped_queue += 1;
                    return Verdict::Drop(DropReason::QueueFull);
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
        let corrupt = self.chance(self.params.corrupt);
        self.stats.delivered_packets += 1;
        self.stats.delivered_bytes += counted;
        self.stats.corrupted += u64::from(corrupt);
        let mut at = start + serialised + self.propagation_delay();
        if !self.params.reorder {
            at = self.last_at.map_or(at, |last| last.max(at));
        }
        self.last_at = Some(self.last_at.map_or(at, |last| last.max(at)));
        Verdict::Deliver { at, corrupt }
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
    /// with its delivery instant.
    fn pass(&mut self, now: Instant, data: &[u8]) -> Option<(Instant, Vec<u8>)> {
        match self.offer(now, data.len()) {
            Verdict::Deliver { at, corrupt } => {
                let mut data = data.to_vec();
                if corrupt {
                    self.corrupt_in_place(&mut data);
                }
                Some((at, data))
            }
            Verdict::Drop(_) => None,
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
/// `up` link and are sent to `forward` from a second socket; datagrams from
/// `forward` pass the `down` link and go back to the last client address
/// seen. Socket buffers are raised to 64 MiB (forced past the sysctl limit
/// when the process has `CAP_NET_ADMIN`). Must be called inside a Tokio runtime.
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
    let server_side = Arc::new(udp_socket(SocketAddr::new(any, 0))?);
    let local_addr = client_side.local_addr()?;
    let up = Arc::new(Mutex::new(LinkModel::new(up)));
    let down = Arc::new(Mutex::new(LinkModel::new(down)));
    let client = Arc::new(Mutex::new(None::<SocketAddr>));
    let seen = Arc::clone(&client);
    let up_task = tokio::spawn(pump(
        Arc::clone(&client_side),
        Arc::clone(&server_side),
        Arc::clone(&up),
        move |from| {
            *lock(&seen) = Some(from);
            Some(forward)
        },
    ));
    let down_task = tokio::spawn(pump(
        server_side,
        client_side,
        Arc::clone(&down),
        move |from| (from == forward).then(|| *lock(&client)).flatten(),
    ));
    Ok(Relay {
        local_addr,
        up,
        down,
        tasks: vec![up_task, down_task],
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

/// One relay direction: receive on `rx`, run `model`, send on `tx` when due.
/// `route` maps a sender address to the destination (`None` discards).
async fn pump<F>(rx: Arc<UdpSocket>, tx: Arc<UdpSocket>, model: Arc<Mutex<LinkModel>>, mut route: F)
where
    F: FnMut(SocketAddr) -> Option<SocketAddr>,
{
    let mut buf = vec![0u8; MAX_DATAGRAM_BYTES];
    let mut pending: VecDeque<(Instant, SocketAddr, Vec<u8>)> = VecDeque::new();
    loop {
        let head = pending.front().map(|(at, _, _)| *at);
        tokio::select! {
            received = rx.recv_from(&mut buf) => match received {
                Ok((len, from)) => {
                    let Some(dest) = route(from) else { continue };
                    if let Some((at, data)) = lock(&model).pass(Instant::now(), &buf[..len]) {
                        pending.push_back((at, dest, data));
                    }
                }
                Err(err) => tracing::debug!(%err, "link-emu relay: receive failed"),
            },
            () = sleep_until_opt(head) => {
                let now = Instant::now();
                while let Some((_, dest, data)) = pop_due(&mut pending, now, |item| item.0) {
                    if let Err(err) = tx.send_to(&data, dest).await {
                        tracing::debug!(%err, %dest, "link-emu relay: send failed");
                    }
                }
            }
        }
    }
}

/// Pop the head of a FIFO delivery queue if it is due at `now`.
fn pop_due<T>(queue: &mut VecDeque<T>, now: Instant, due: impl Fn(&T) -> Instant) -> Option<T> {
    if queue.front().is_some_and(|item| due(item) <= now) {
        queue.pop_front()
    } else {
        None
    }
}

/// A datagram inside the in-memory path.
#[derive(Debug)]
struct Datagram {
    at: Instant,
    from: SocketAddr,
    ecn: Option<EcnCodepoint>,
    data: Vec<u8>,
}

/// One direction of the in-memory path: the model and datagrams in flight.
#[derive(Debug)]
struct Pipe {
    state: Mutex<(LinkModel, VecDeque<Datagram>)>,
    /// Signalled when the in-flight queue goes from empty to non-empty.
    wake_delivery: Notify,
}

#[derive(Debug, Default)]
struct Inbox {
    queue: VecDeque<Datagram>,
    waker: Option<Waker>,
}

/// One end of an in-memory emulated link; implements
/// [`quinn::AsyncUdpSocket`]. Datagrams addressed to anything but the peer's
/// address are discarded. No GSO/GRO: one datagram per transmit and receive.
#[derive(Debug)]
pub struct MemorySocket {
    addr: SocketAddr,
    peer: SocketAddr,
    out: Arc<Pipe>,
    inbox: Arc<Mutex<Inbox>>,
    delivery: AbortHandle,
}

impl MemorySocket {
    /// Counters of the direction from this socket to its peer.
    pub fn stats(&self) -> LinkStats {
        lock(&self.out.state).0.stats()
    }
}

impl Drop for MemorySocket {
    fn drop(&mut self) {
        self.delivery.abort();
    }
}

/// Two connected in-memory sockets with addresses `a` and `b`, joined by a
/// link with parameters `a_to_b` and `b_to_a`. Use with
/// `quinn::Endpoint::new_with_abstract_socket(.., socket, Arc::new(quinn::TokioRuntime))`.
/// Must be called inside a Tokio runtime (it spawns one delivery task per
/// direction, stopped when the sending socket is dropped).
pub fn memory_pair(
    a: SocketAddr,
    b: SocketAddr,
    a_to_b: LinkParams,
    b_to_a: LinkParams,
) -> (Arc<MemorySocket>, Arc<MemorySocket>) {
    let inbox_a = Arc::new(Mutex::new(Inbox::default()));
    let inbox_b = Arc::new(Mutex::new(Inbox::default()));
    let end = |addr, peer, params, inbox, peer_inbox: &Arc<Mutex<Inbox>>| {
        let out = Arc::new(Pipe {
            state: Mutex::new((LinkModel::new(params), VecDeque::new())),
            wake_delivery: Notify::new(),
        });
        let delivery =
            tokio::spawn(deliver(Arc::clone(&out), Arc::downgrade(peer_inbox))).abort_handle();
        Arc::new(MemorySocket {
            addr,
            peer,
            out,
            inbox,
            delivery,
        })
    };
    let socket_a = end(a, b, a_to_b, Arc::clone(&inbox_a), &inbox_b);
    let socket_b = end(b, a, b_to_a, inbox_b, &inbox_a);
    (socket_a, socket_b)
}

/// Move due datagrams from `pipe` to `inbox`, sleeping until the next is due.
/// Exits when the receiving socket (owner of `inbox`) is dropped.
async fn deliver(pipe: Arc<Pipe>, inbox: Weak<Mutex<Inbox>>) {
    while let Some(inbox) = inbox.upgrade() {
        let now = Instant::now();
        let (waker, next) = {
            let mut state = lock(&pipe.state);
            let mut inbox = lock(&inbox);
            let mut moved = false;
            while let Some(datagram) = pop_due(&mut state.1, now, |d| d.at) {
                inbox.queue.push_back(datagram);
                moved = true;
            }
            let waker = if moved { inbox.waker.take() } else { None };
            (waker, state.1.front().map(|d| d.at))
        };
        drop(inbox);
        if let Some(waker) = waker {
            waker.wake();
        }
        match next {
            Some(at) => tokio::time::sleep_until(at.into()).await,
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
        if transmit.destination != self.peer {
            return Ok(());
        }
        let segment = transmit
            .segment_size
            .unwrap_or(transmit.contents.len())
            .max(1);
        let now = Instant::now();
        let mut state = lock(&self.out.state);
        let (model, in_flight) = &mut *state;
        let was_empty = in_flight.is_empty();
        for chunk in transmit.contents.chunks(segment) {
            if let Some((at, data)) = model.pass(now, chunk) {
                in_flight.push_back(Datagram {
                    at,
                    from: self.addr,
                    ecn: transmit.ecn,
                    data,
                });
            }
        }
        let notify = was_empty && !in_flight.is_empty();
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
            if let Verdict::Deliver { at, corrupt } = m.offer(offered_at, rng.gen_range(0..1400)) {
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
}
