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

use std::fs::File;
use std::io::{Read, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Parser;
use ferry_linkemu::{DropReason, LinkModel, LinkParams, Verdict};
use nix::sched::CloneFlags;
use nix::sys::signal::{SigSet, Signal};
use wanem::{DelayLine, DirectionStats};

/// Smallest default queue (bytes): 64 packets of 1500 bytes, for RTTs so
/// short that one bandwidth-delay product holds almost nothing.
const MIN_QUEUE_BYTES: u64 = 64 * 1500;

/// Largest packet read from a TUN device (bytes); the devices' MTU is far
/// below it.
const MAX_PACKET_BYTES: usize = 65_536;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "User-space WAN emulator between two network namespaces (TUN devices, IP layer).",
    long_about = "User-space WAN emulator between two network namespaces (TUN devices, IP \
                  layer): per-direction one-way delay (RTT/2), jitter without reordering \
                  (unless --reorder), random loss, and a rate cap with a bounded FIFO \
                  (default one bandwidth-delay product, tail drop). Needs root \
                  (CAP_NET_ADMIN). Usually started by ops/wanem/netns, which also creates \
                  the namespaces. Stops on SIGINT or SIGTERM; the devices go with it."
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
    /// Let the kernel process packets written into each device in NAPI
    /// batches (IFF_NAPI), which allows GRO at the receiving end.
    #[arg(long)]
    napi: bool,
    /// Write counters as JSON to this file every 200 ms and at exit
    /// (replaced atomically): `{"pid", "a_to_b": {...}, "b_to_a": {...}}`
    /// with the fields of `wanem::DirectionStats`.
    #[arg(long)]
    stats: Option<PathBuf>,
}

/// One direction: its model, its delay line and its counters.
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
    let a = create_device(
        &args.a_netns,
        &args.dev,
        args.a_addr,
        args.b_addr,
        args.mtu,
        args.napi,
    )?;
    let b = create_device(
        &args.b_netns,
        &args.dev,
        args.b_addr,
        args.a_addr,
        args.mtu,
        args.napi,
    );
    nix::sched::setns(&home, CloneFlags::CLONE_NEWNET).context("returning to own namespace")?;
    let b = b?;

    let dir = |name, seed| {
        Arc::new(Direction {
            name,
            model: Mutex::new(LinkModel::new(LinkParams {
                seed,
                ..params.clone()
            })),
            line: Mutex::new(DelayLine::new()),
            ready: Condvar::new(),
            stats: Mutex::new(DirectionStats::default()),
        })
    };
    let ab = dir("a_to_b", args.seed);
    let ba = dir("b_to_a", args.seed.wrapping_add(1));
    let (a_read, a_write) = a.split();
    let (b_read, b_write) = b.split();
    let stop = Arc::new(AtomicBool::new(false));
    let window = args.release_window;
    spawn("wanem-read-a", {
        let d = ab.clone();
        move || reader(a_read, &d)
    })?;
    spawn("wanem-read-b", {
        let d = ba.clone();
        move || reader(b_read, &d)
    })?;
    spawn("wanem-write-b", {
        let (d, stop) = (ab.clone(), stop.clone());
        move || writer(b_write, &d, window, &stop)
    })?;
    spawn("wanem-write-a", {
        let (d, stop) = (ba.clone(), stop.clone());
        move || writer(a_write, &d, window, &stop)
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
        "wanem: ready: {} {} <-> {} {} on {}, RTT {:?}, {} bit/s each way, queue {} bytes, loss {}, jitter {:?}{}",
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
/// there with `addr` and point-to-point peer `peer`, up. The caller returns
/// to its own namespace afterwards.
fn create_device(
    netns: &str,
    dev: &str,
    addr: Ipv4Addr,
    peer: Ipv4Addr,
    mtu: u16,
    napi: bool,
) -> Result<tun::Device> {
    let path = Path::new("/var/run/netns").join(netns);
    let ns = File::open(&path).with_context(|| {
        format!(
            "network namespace {netns:?} ({}) not found; create it with `ip netns add {netns}` or use ops/wanem/netns",
            path.display()
        )
    })?;
    nix::sched::setns(&ns, CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("entering network namespace {netns:?}"))?;
    let mut cfg = tun::Configuration::default();
    cfg.tun_name(dev)
        .layer(tun::Layer::L3)
        .address(addr)
        .destination(peer)
        .netmask(Ipv4Addr::new(255, 255, 255, 255))
        .mtu(mtu)
        .up()
        .platform_config(|p| {
            p.napi(napi);
        });
    tun::create(&cfg).with_context(|| format!("creating TUN device {dev} in {netns:?}"))
}

/// Reads packets from one device and offers them to `d`.
fn reader(mut dev: impl Read, d: &Direction) {
    let mut buf = vec![0u8; MAX_PACKET_BYTES];
    loop {
        let n = match dev.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                eprintln!("wanem: {}: read failed: {e}", d.name);
                return;
            }
        };
        let now = Instant::now();
        let verdict = lock(&d.model).offer_packet(now, n);
        let mut stats = lock(&d.stats);
        stats.offered_packets += 1;
        match verdict {
            // No copies: wanem leaves `duplicate` at 0.
            Verdict::Deliver { at, .. } => {
                drop(stats);
                let mut line = lock(&d.line);
                let was_next = line.next_due();
                line.push(at, buf[..n].to_vec());
                let held = line.bytes();
                drop(line);
                // Wake the writer only if this packet is now the first due.
                if was_next.is_none_or(|next| at < next) {
                    d.ready.notify_one();
                }
                let mut stats = lock(&d.stats);
                stats.max_held_bytes = stats.max_held_bytes.max(held);
            }
            Verdict::Drop(DropReason::Loss) => stats.dropped_loss += 1,
            Verdict::Drop(DropReason::QueueFull) => stats.dropped_queue += 1,
            // wanem never cuts its link.
            Verdict::Drop(DropReason::Cut) => stats.dropped_loss += 1,
        }
    }
}

/// Writes the packets of `d` into the other device at their instants.
fn writer(mut dev: impl Write, d: &Direction, window: Duration, stop: &AtomicBool) {
    // Wake at the instant asked for: the default 50 µs timer slack would
    // add to every delivery.
    if let Err(e) = nix::sys::prctl::set_timerslack(1_000) {
        eprintln!("wanem: {}: timer slack not set: {e}", d.name);
    }
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
        written.extend(due.iter().map(|p| dev.write(p).is_ok()));
        let mut stats = lock(&d.stats);
        for (p, ok) in due.iter().zip(&written) {
            if *ok {
                stats.delivered(p);
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
