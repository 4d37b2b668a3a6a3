//! `wanem`: a user-space WAN emulator at the IP layer between two network
//! namespaces.
//!
//! It creates one TUN device in each namespace (point-to-point, the two
//! addresses routed to each other), reads every IP packet the kernel sends
//! into one device, passes it through the link model of its direction
//! (random loss, rate cap with a bounded FIFO and tail drop, one-way delay,
//! jitter) and writes it into the other device at its delivery instant. TCP
//! and QUIC cross the same emulated link, so their results compare.
//!
//! Timing: a writer thread per direction sleeps on a condition variable
//! until the next delivery instant (a high-resolution kernel timer, no busy
//! wait, no 1 ms tick) and then releases every packet due within
//! `--release-window` (default 50 µs), so one wake-up serves several
//! packets at 1 Gbit/s. Normally run through `ops/wanem/netns`, which
//! creates the namespaces and tunes their socket buffers.
//!
//! Offloads (`--offload`, the default; `--no-offload` reads and writes one
//! packet per system call): the devices are opened with `IFF_VNET_HDR` and
//! TCP and UDP segmentation offload (`TUN_F_TSO4/6`, `TUN_F_USO4/6`; UDP
//! needs Linux 6.2), so the kernel hands the emulator GSO super-packets of
//! up to 64 KiB in one read instead of segmenting them first. The
//! emulator splits each into its MTU-sized segments (as the kernel would
//! have) and offers EVERY segment to the link model on its own: each is
//! charged by the rate cap, can be tail-dropped by the queue or lost at
//! random, and gets its own delivery instant, so the model and the counters
//! (`DirectionStats`, in packets) are the same as without offloads. A
//! kernel that refuses the offload flags gets the one-packet path, with a
//! warning. The `tun-rs` crate does the `virtio_net_hdr` framing and the
//! splitting.
//!
//! On the way out each segment is still written on its own: coalescing the
//! segments of one release into GSO writes (tun-rs `send_multiple` with
//! its GRO table) stalled iperf3 TCP flows through the emulator with
//! retransmission timeouts (Linux 6.18, tun-rs 2.8.16) while the same
//! segments written one by one did not, so it is left out until that is
//! understood.

use std::fs::File;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use ferry_linkemu::{LinkModel, LinkParams};
use nix::sched::CloneFlags;
use nix::sys::signal::{SigSet, Signal};
use tun_rs::{DeviceBuilder, GROTable, Layer, SyncDevice, IDEAL_BATCH_SIZE, VIRTIO_NET_HDR_LEN};
use wanem::{offer_segments, DelayLine, DirectionStats};

/// Smallest default queue (bytes): 64 packets of 1500 bytes, for RTTs so
/// short that one bandwidth-delay product holds almost nothing.
const MIN_QUEUE_BYTES: u64 = 64 * 1500;

/// Largest packet read from a TUN device (bytes): without offloads the
/// devices' MTU is far below it; with them, a GSO super-packet (IP length
/// field: at most 65,535 bytes) after its `virtio_net_hdr`.
const MAX_PACKET_BYTES: usize = 65_536 + VIRTIO_NET_HDR_LEN;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "User-space WAN emulator between two network namespaces (TUN devices, IP layer).",
    long_about = "User-space WAN emulator between two network namespaces (TUN devices, IP \
                  layer): per-direction one-way delay (RTT/2), jitter without reordering \
                  (unless --reorder), random loss, and a rate cap with a bounded FIFO \
                  (default one bandwidth-delay product, tail drop). With offloads (the \
                  default), the kernel hands over GSO super-packets; each is split into its \
                  MTU-sized segments and every segment goes through the model on its own \
                  (rate, queue, loss, delay) and is written on its own. Needs root (CAP_NET_ADMIN). Usually started \
                  by ops/wanem/netns, which also creates the namespaces. Stops on SIGINT or \
                  SIGTERM; the devices go with it."
)]
struct Args {
    /// Namespace of side A (a name under /var/run/netns).
    #[arg(long, default_value = "ferry-src")]
    a_netns: String,
    /// Namespace of side B.
    #[arg(long, default_value = "ferry-dst")]
    b_netns: String,
    /// TUN device name, created in both namespaces.
    #[arg(long, default_value = "wan0")]
    dev: String,
    /// IPv4 address of side A (its peer is side B's address).
    #[arg(long, default_value = "10.47.0.1")]
    a_addr: Ipv4Addr,
    /// IPv4 address of side B.
    #[arg(long, default_value = "10.47.0.2")]
    b_addr: Ipv4Addr,
    /// Device MTU in bytes (the measures assume 1500).
    #[arg(long, default_value_t = 1500)]
    mtu: u16,
    /// Round-trip time; each direction delays by half of it.
    #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
    rtt: Duration,
    /// Rate cap of each direction on IP bytes, e.g. 1Gbit/s, 300Mbit/s.
    #[arg(long, default_value = "1Gbit/s", value_parser = ferry_proto::units::parse_rate)]
    rate: u64,
    /// Queue in front of the rate cap, bytes (tail drop). Default: one
    /// bandwidth-delay product (rate x RTT / 8), at least 96,000 bytes.
    #[arg(long, value_parser = ferry_proto::units::parse_size)]
    queue: Option<u64>,
    /// Random loss probability per packet and direction, 0..1 (e.g. 0.01).
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    /// Jitter: each packet's one-way delay varies uniformly by up to this
    /// much either way (e.g. 2ms).
    #[arg(long, default_value = "0s", value_parser = humantime::parse_duration)]
    jitter: Duration,
    /// Let jitter reorder packets (off: a packet never overtakes an earlier one).
    #[arg(long)]
    reorder: bool,
    /// Seed of the loss and jitter random numbers.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Packets due within this much of a wake-up are released together
    /// (the most a packet is early).
    #[arg(long, default_value = "50us", value_parser = humantime::parse_duration)]
    release_window: Duration,
    /// Open the devices with TCP and UDP segmentation offload
    /// (IFF_VNET_HDR): one read brings a GSO super-packet, split here into
    /// MTU-sized segments each charged by the model on its own and written
    /// on its own. The default; a kernel that refuses gets the one-packet
    /// path with a warning.
    #[arg(long, overrides_with = "no_offload")]
    offload: bool,
    /// One packet per read and per write (no IFF_VNET_HDR).
    #[arg(long, overrides_with = "offload")]
    no_offload: bool,
    /// Write counters as JSON to this file every 200 ms and at exit
    /// (replaced atomically): `{"pid", "a_to_b": {...}, "b_to_a": {...}}`
    /// with the fields of `wanem::DirectionStats`.
    #[arg(long)]
    stats: Option<PathBuf>,
}

/// One direction: its model, its delay line and its counters. Lock order:
/// model, line, stats.
struct Direction {
    name: &'static str,
    model: Mutex<LinkModel>,
    line: Mutex<DelayLine>,
    ready: Condvar,
    stats: Mutex<DirectionStats>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("wanem: error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = Args::parse();
    if !nix::unistd::geteuid().is_root() {
        bail!("needs root (CAP_NET_ADMIN) to create TUN devices in other namespaces; run it with sudo, or through ops/wanem/netns as root");
    }
    if !(0.0..1.0).contains(&args.loss) {
        bail!("--loss {} is outside 0..1", args.loss);
    }
    if args.rtt.is_zero() && !args.jitter.is_zero() {
        bail!("--jitter needs a non-zero --rtt");
    }
    let mut params = LinkParams::new(args.rate, args.rtt);
    // A BDP queue is tiny at a short RTT: keep room for a burst of packets.
    params.queue_bytes = params.queue_bytes.max(MIN_QUEUE_BYTES);
    if let Some(q) = args.queue {
        if q < u64::from(args.mtu) {
            bail!(
                "--queue {q} is smaller than one packet ({} bytes)",
                args.mtu
            );
        }
        params.queue_bytes = q;
    }
    params.loss = args.loss;
    params.jitter = args.jitter;
    params.reorder = args.reorder;

    // Signals go to the main thread only (blocked before any thread starts).
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGINT);
    signals.add(Signal::SIGTERM);
    signals.thread_block().context("blocking SIGINT/SIGTERM")?;

    let home = File::open("/proc/thread-self/ns/net").context("opening own network namespace")?;
    // `--offload` and `--no-offload` override each other: at most one is set.
    let want_offload = args.offload || !args.no_offload;
    let a = create_device(
        &args.a_netns,
        &args.dev,
        args.a_addr,
        args.b_addr,
        args.mtu,
        want_offload,
    );
    // Both devices use one framing: if A could not get offloads, B does
    // without too.
    let b = a.as_ref().ok().map(|a| {
        create_device(
            &args.b_netns,
            &args.dev,
            args.b_addr,
            args.a_addr,
            args.mtu,
            a.tcp_gso(),
        )
    });
    nix::sched::setns(&home, CloneFlags::CLONE_NEWNET).context("returning to own namespace")?;
    let a = Arc::new(a?);
    let b = match b {
        Some(b) => Arc::new(b?),
        // Not reached: `a?` returned A's error above.
        None => bail!("device of side A missing"),
    };
    // B could have fallen back alone: stop rather than run the two
    // directions with different framings.
    let offload = a.tcp_gso() && b.tcp_gso();
    if a.tcp_gso() != b.tcp_gso() {
        bail!(
            "offloads on one device only (side A: {}, side B: {}); run with --no-offload",
            a.tcp_gso(),
            b.tcp_gso()
        );
    }
    let offload_note = match (offload, a.udp_gso() && b.udp_gso()) {
        (false, _) => "offload off",
        (true, true) => "offload TCP and UDP segmentation",
        (true, false) => {
            "offload TCP segmentation only (no UDP segmentation offload in this kernel)"
        }
    };
    let headroom = if offload { VIRTIO_NET_HDR_LEN } else { 0 };

    let dir = |name, seed| {
        Arc::new(Direction {
            name,
            model: Mutex::new(LinkModel::new(LinkParams {
                seed,
                ..params.clone()
            })),
            line: Mutex::new(DelayLine::with_headroom(headroom)),
            ready: Condvar::new(),
            stats: Mutex::new(DirectionStats::default()),
        })
    };
    let ab = dir("a_to_b", args.seed);
    let ba = dir("b_to_a", args.seed.wrapping_add(1));
    let stop = Arc::new(AtomicBool::new(false));
    let window = args.release_window;
    let mtu = usize::from(args.mtu);
    spawn("wanem-read-a", {
        let (d, dev) = (ab.clone(), a.clone());
        move || reader(&dev, &d, mtu)
    })?;
    spawn("wanem-read-b", {
        let (d, dev) = (ba.clone(), b.clone());
        move || reader(&dev, &d, mtu)
    })?;
    spawn("wanem-write-b", {
        let (d, stop, dev) = (ab.clone(), stop.clone(), b.clone());
        move || writer(&dev, &d, window, &stop)
    })?;
    spawn("wanem-write-a", {
        let (d, stop, dev) = (ba.clone(), stop.clone(), a.clone());
        move || writer(&dev, &d, window, &stop)
    })?;
    if let Some(path) = args.stats.clone() {
        let dirs = [ab.clone(), ba.clone()];
        let stop = stop.clone();
        spawn("wanem-stats", move || {
            while !stop.load(Ordering::Relaxed) {
                if let Err(e) = write_stats(&path, &dirs) {
                    eprintln!("wanem: stats file {}: {e:#}", path.display());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        })?;
    }
    println!(
        "wanem: ready: {} {} <-> {} {} on {}, RTT {:?}, {} bit/s each way, queue {} bytes, loss {}, jitter {:?}{}, {offload_note}",
        args.a_netns,
        args.a_addr,
        args.b_netns,
        args.b_addr,
        args.dev,
        args.rtt,
        args.rate,
        params.queue_bytes,
        args.loss,
        args.jitter,
        if args.reorder { " (reordering)" } else { "" }
    );
    std::io::stdout().flush().ok();

    let sig = signals.wait().context("waiting for a signal")?;
    stop.store(true, Ordering::Relaxed);
    if let Some(path) = &args.stats {
        write_stats(path, &[ab.clone(), ba.clone()])?;
    }
    for d in [&ab, &ba] {
        let s = *lock(&d.stats);
        eprintln!(
            "wanem: {sig}: {}: {} packets ({} bytes) delivered, {} lost at random, {} tail-dropped",
            d.name, s.delivered_packets, s.delivered_bytes, s.dropped_loss, s.dropped_queue
        );
    }
    // The reader threads block in read(2); exiting closes the devices.
    std::process::exit(0);
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<()> {
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(f)
        .with_context(|| format!("starting thread {name}"))?;
    Ok(())
}

/// Enters namespace `netns` (this thread only) and creates TUN device `dev`
/// there with `addr` and point-to-point peer `peer`, up, with offloads if
/// `offload` and the kernel allows them (otherwise without, after a
/// warning). The caller returns to its own namespace afterwards.
fn create_device(
    netns: &str,
    dev: &str,
    addr: Ipv4Addr,
    peer: Ipv4Addr,
    mtu: u16,
    offload: bool,
) -> Result<SyncDevice> {
    let path = Path::new("/var/run/netns").join(netns);
    let ns = File::open(&path).with_context(|| {
        format!(
            "network namespace {netns:?} ({}) not found; create it with `ip netns add {netns}` or use ops/wanem/netns",
            path.display()
        )
    })?;
    nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("entering network namespace {netns:?}"))?;
    let build = |offload: bool| {
        DeviceBuilder::new()
            .name(dev)
            .layer(Layer::L3)
            .ipv4(addr, 32, Some(peer))
            .mtu(mtu)
            .enable(true)
            .with(|b| {
                b.offload(offload);
            })
            .build_sync()
    };
    if offload {
        match build(true) {
            Ok(d) if d.tcp_gso() => return Ok(d),
            Ok(_) => eprintln!(
                "wanem: warning: {dev} in {netns:?}: the kernel took no offloads; one packet per read and write"
            ),
            Err(e) => eprintln!(
                "wanem: warning: {dev} in {netns:?}: offloads refused ({e}); one packet per read and write"
            ),
        }
    }
    build(false).with_context(|| format!("creating TUN device {dev} in {netns:?}"))
}

/// Reads packets from one device and offers them to `d`: with offloads,
/// each GSO super-packet split into segments of at most `mtu` bytes, every
/// segment offered on its own.
fn reader(dev: &SyncDevice, d: &Direction, mtu: usize) {
    let mut raw = vec![0u8; MAX_PACKET_BYTES];
    // Without offloads one packet per read lands in segs[0].
    let (n_segs, seg_len) = if dev.tcp_gso() {
        (IDEAL_BATCH_SIZE, mtu)
    } else {
        (1, MAX_PACKET_BYTES)
    };
    let mut segs = vec![vec![0u8; seg_len]; n_segs];
    let mut sizes = vec![0usize; n_segs];
    loop {
        let n = if dev.tcp_gso() {
            dev.recv_multiple(&mut raw, &mut segs, &mut sizes, 0)
        } else {
            // A read of 0 bytes (the device went away) yields no packet.
            dev.recv(&mut segs[0]).map(|n| {
                sizes[0] = n;
                usize::from(n > 0)
            })
        };
        let n = match n {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // The device failed: stop this direction.
            Err(e) if e.raw_os_error().is_some() => {
                eprintln!("wanem: {}: read failed: {e}", d.name);
                return;
            }
            // A super-packet tun-rs could not split: drop it, count it.
            Err(e) => {
                let mut stats = lock(&d.stats);
                stats.ingress_reads += 1;
                stats.split_errors += 1;
                if stats.split_errors <= 10 {
                    eprintln!("wanem: {}: super-packet dropped: {e}", d.name);
                }
                continue;
            }
        };
        let now = Instant::now();
        let mut model = lock(&d.model);
        let mut line = lock(&d.line);
        let mut stats = lock(&d.stats);
        stats.ingress_reads += 1;
        let wake = offer_segments(
            &mut model,
            &mut line,
            &mut stats,
            now,
            segs.iter().zip(&sizes).take(n).map(|(s, &len)| &s[..len]),
        );
        drop((stats, line, model));
        if wake {
            d.ready.notify_one();
        }
    }
}

/// Writes the packets of `d` into the other device at their instants, one
/// per write (with offloads, behind a `virtio_net_hdr` saying no GSO).
fn writer(dev: &SyncDevice, d: &Direction, window: Duration, stop: &AtomicBool) {
    // Wake at the instant asked for: the default 50 µs timer slack would
    // add to every delivery.
    if let Err(e) = nix::sys::prctl::set_timerslack(1_000) {
        eprintln!("wanem: {}: timer slack not set: {e}", d.name);
    }
    let offload = dev.tcp_gso();
    let headroom = if offload { VIRTIO_NET_HDR_LEN } else { 0 };
    let mut gro = GROTable::new();
    let mut due = Vec::new();
    let mut written = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        {
            let mut line = lock(&d.line);
            loop {
                let now = Instant::now();
                match line.next_due() {
                    None => {
                        line = d
                            .ready
                            .wait_timeout(line, Duration::from_millis(100))
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                    }
                    Some(at) if at > now + window => {
                        line = d
                            .ready
                            .wait_timeout(line, at - now)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0;
                    }
                    Some(_) => {
                        line.pop_due(now, window, &mut due);
                        break;
                    }
                }
            }
        }
        written.clear();
        written.extend(due.iter_mut().map(|p| {
            if offload {
                // One packet per write behind a GSO_NONE header: see the
                // module docs for why segments are not coalesced.
                dev.send_multiple(&mut gro, std::slice::from_mut(p), headroom)
                    .is_ok()
            } else {
                dev.send(p).is_ok()
            }
        }));
        let mut stats = lock(&d.stats);
        for (p, ok) in due.iter().zip(&written) {
            if *ok {
                stats.delivered(&p[headroom..]);
            } else {
                stats.write_errors += 1;
            }
        }
        drop(stats);
        due.clear();
    }
}

fn write_stats(path: &Path, dirs: &[Arc<Direction>; 2]) -> Result<()> {
    let json = serde_json::json!({
        "pid": std::process::id(),
        "a_to_b": *lock(&dirs[0].stats),
        "b_to_a": *lock(&dirs[1].stats),
    });
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(&json)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}
