//! `quinn-bare`: the CPU cost of a bare quinn transfer on loopback, the
//! baseline of the "cpu" benchmark scenario (Ferry's sender plus receiver CPU
//! is compared against it).
//!
//! One process holds both ends: a server endpoint and a client endpoint, each
//! on `127.0.0.1:0`, quinn 0.11 with rustls (ring) and a self-signed rcgen
//! certificate for `localhost` that the client trusts through a
//! `RootCertStore` holding exactly that certificate.
//!
//! The transport is deliberately *not* Ferry's
//! (`replicator::transport::transport_config`): it is quinn's defaults
//! (default congestion controller, Cubic) with only the flow-control windows
//! raised so that loopback is not window-limited (stream receive window
//! 64 MiB, connection receive window 256 MiB, send window 256 MiB), and the
//! server's concurrent unidirectional stream limit raised to `--streams` if
//! that exceeds quinn's default of 100.
//!
//! With `--connections N` the client has N endpoints (each its own UDP
//! socket, as a Ferry link's connections are) and opens one connection
//! from each to the one server endpoint; `--bytes` is split evenly across
//! the connections. On each connection the client opens `--streams`
//! unidirectional streams concurrently and writes its part, split evenly, as `Bytes` slices of one
//! preallocated 1 MiB buffer of pseudo-random bytes (handed to quinn without
//! copying), then finishes the streams. The server reads every stream to its end
//! with `read_chunk`, discarding the data and counting bytes. The measured
//! interval runs from the established connection to the server having
//! counted all bytes; certificate generation, endpoint setup, the handshake
//! and the closing are outside it. CPU is `getrusage(RUSAGE_SELF)` user plus
//! system time over that interval, i.e. both endpoints and every runtime
//! thread.
//!
//! Output: a human-readable line on stderr and one JSON line on stdout.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use bytes::Bytes;
use clap::Parser;
use nix::sys::resource::{getrusage, UsageWho};
use nix::sys::time::TimeVal;
use quinn::{Connection, Endpoint, TransportConfig, VarInt};
use rand::RngCore;
use serde::Serialize;
use tokio::task::JoinSet;

/// Size of the preallocated source buffer every write is a slice of.
const BUF_LEN: usize = 1 << 20;
/// Per-stream receive window (64 MiB).
const STREAM_RECEIVE_WINDOW: u32 = 64 << 20;
/// Connection receive window (256 MiB).
const RECEIVE_WINDOW: u32 = 256 << 20;
/// Connection send window (256 MiB).
const SEND_WINDOW: u64 = 256 << 20;
/// quinn's default limit on concurrent incoming unidirectional streams.
const QUINN_DEFAULT_UNI_STREAMS: u32 = 100;

/// The stdout JSON line, fields in this order.
#[derive(Debug, Serialize)]
struct Report {
    /// Always "quinn".
    tool: &'static str,
    /// Payload bytes the server counted.
    bytes: u64,
    /// Wall seconds of the measured interval.
    wall_s: f64,
    /// Process user CPU seconds over the interval.
    cpu_user_s: f64,
    /// Process system CPU seconds over the interval.
    cpu_sys_s: f64,
    /// `cpu_user_s + cpu_sys_s`.
    cpu_s: f64,
    /// QUIC connections the payload was split across.
    connections: u32,
    /// `cpu_s` per 10^9 payload bytes.
    cpu_s_per_gb: f64,
    /// Payload bits per wall second.
    goodput_bps: f64,
}

/// Measures the CPU cost (user + system seconds) of a bare quinn transfer
/// between two endpoints in this process over loopback UDP, and prints one
/// JSON line on stdout: {"tool":"quinn","bytes","wall_s","cpu_user_s",
/// "cpu_sys_s","cpu_s","cpu_s_per_gb","goodput_bps"}.
#[derive(Debug, Parser)]
#[command(
    name = "quinn-bare",
    version,
    after_help = "JSON fields: bytes = payload bytes transferred; wall_s = seconds from the \
                  established connection until the server has read every byte; cpu_user_s / \
                  cpu_sys_s / cpu_s = process user / system / total CPU seconds over that \
                  interval (both endpoints, all threads); cpu_s_per_gb = cpu_s per 10^9 payload \
                  bytes; goodput_bps = payload bits per second of wall time."
)]
struct Args {
    /// Total payload to transfer, in bytes. A plain integer, or a number with
    /// a unit: B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of
    /// 1024), e.g. 1.4GB, 300MB, 512MiB.
    #[arg(long, default_value = "1400000000", value_parser = parse_bytes)]
    bytes: u64,

    /// Number of unidirectional streams each connection's part is split
    /// across, opened concurrently (1 to 10000).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    streams: u32,

    /// Number of QUIC connections (1 to 64), each from its own client
    /// endpoint and UDP socket; the payload is split evenly across them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    connections: u32,
}

/// Parses a byte count with [`ferry_proto::units::parse_size`] (e.g.
/// `1400000000`, `1.4GB`, `512MiB`); zero is refused.
fn parse_bytes(s: &str) -> Result<u64, String> {
    match ferry_proto::units::parse_size(s)? {
        0 => Err("the byte count must be at least 1".into()),
        n => Ok(n),
    }
}

/// Process CPU time so far: (user, system) seconds, all threads.
fn cpu_times() -> Result<(f64, f64)> {
    let usage = getrusage(UsageWho::RUSAGE_SELF).context("getrusage(RUSAGE_SELF)")?;
    let secs = |t: TimeVal| t.tv_sec() as f64 + t.tv_usec() as f64 / 1e6;
    Ok((secs(usage.user_time()), secs(usage.system_time())))
}

/// Quinn's default transport with only the flow-control windows raised (and
/// the incoming uni stream limit raised to `streams` if above the default).
fn transport(streams: u32) -> Arc<TransportConfig> {
    let mut t = TransportConfig::default();
    t.stream_receive_window(VarInt::from_u32(STREAM_RECEIVE_WINDOW))
        .receive_window(VarInt::from_u32(RECEIVE_WINDOW))
        .send_window(SEND_WINDOW);
    if streams > QUINN_DEFAULT_UNI_STREAMS {
        t.max_concurrent_uni_streams(VarInt::from_u32(streams));
    }
    Arc::new(t)
}

/// A server endpoint and `clients` client endpoints on loopback (each its
/// own UDP socket), the clients trusting exactly the server's self-signed
/// `localhost` certificate.
fn endpoints(streams: u32, clients: u32) -> Result<(Endpoint, Vec<Endpoint>)> {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()])
        .context("generating the self-signed certificate")?;
    let cert_der = cert.cert.der().clone();
    let key = rustls::pki_types::PrivatePkcs8KeyDer::from(cert.key_pair.serialize_der());

    let mut server_config =
        quinn::ServerConfig::with_single_cert(vec![cert_der.clone()], key.into())
            .context("building the server TLS config")?;
    server_config.transport_config(transport(streams));

    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(cert_der)
        .context("adding the certificate to the root store")?;
    let mut client_config = quinn::ClientConfig::with_root_certificates(Arc::new(roots))
        .context("building the client TLS config")?;
    client_config.transport_config(transport(streams));

    let loopback = SocketAddr::from((Ipv4Addr::LOCALHOST, 0));
    let server =
        Endpoint::server(server_config, loopback).context("binding the server endpoint")?;
    let mut out = Vec::new();
    for _ in 0..clients {
        let mut client = Endpoint::client(loopback).context("binding a client endpoint")?;
        client.set_default_client_config(client_config.clone());
        out.push(client);
    }
    Ok((server, out))
}

/// Accepts uni streams on `conn` and reads each to its end, discarding the
/// data and adding what it read to `counted`, until `counted` (all
/// connections together) reaches `total`. Every receiver is woken through
/// `done` when any stream ends, so one whose connection has no more streams
/// notices when another connection brings the total in.
async fn receive(
    conn: Connection,
    total: u64,
    counted: Arc<std::sync::atomic::AtomicU64>,
    done: Arc<tokio::sync::Notify>,
) -> Result<()> {
    use std::sync::atomic::Ordering;
    let mut readers = JoinSet::new();
    loop {
        let notified = done.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let reached = counted.load(Ordering::Relaxed) >= total;
        if reached && readers.is_empty() {
            return Ok(());
        }
        tokio::select! {
            stream = conn.accept_uni(), if !reached => {
                let mut recv = stream.context("accepting a stream")?;
                let (counted, done) = (counted.clone(), done.clone());
                readers.spawn(async move {
                    while let Some(chunk) = recv
                        .read_chunk(usize::MAX, true)
                        .await
                        .context("reading a stream")?
                    {
                        counted.fetch_add(chunk.bytes.len() as u64, Ordering::Relaxed);
                    }
                    done.notify_waiters();
                    anyhow::Ok(())
                });
            }
            Some(r) = readers.join_next() => {
                r.context("stream reader task")??;
            }
            _ = notified => {}
        }
    }
}

/// Opens `streams` uni streams concurrently and writes `total` bytes across
/// them as slices of `buf`, then finishes every stream.
async fn send(conn: Connection, total: u64, streams: u32, buf: Bytes) -> Result<()> {
    let mut writers = JoinSet::new();
    let (each, rest) = (total / u64::from(streams), total % u64::from(streams));
    for i in 0..u64::from(streams) {
        let len = each + u64::from(i < rest);
        let (conn, buf) = (conn.clone(), buf.clone());
        writers.spawn(async move {
            let mut send = conn.open_uni().await.context("opening a stream")?;
            let mut left = len;
            while left > 0 {
                let n = left.min(buf.len() as u64) as usize;
                send.write_chunk(buf.slice(..n))
                    .await
                    .context("writing a stream")?;
                left -= n as u64;
            }
            send.finish().context("finishing a stream")?;
            anyhow::Ok(())
        });
    }
    while let Some(done) = writers.join_next().await {
        done.context("stream writer task")??;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();

    let mut buf = vec![0u8; BUF_LEN];
    rand::thread_rng().fill_bytes(&mut buf);
    let buf = Bytes::from(buf);

    let (server, clients) = endpoints(args.streams, args.connections)?;
    let server_addr = server.local_addr().context("reading the server address")?;

    let n = args.connections;
    let accept = tokio::spawn({
        let server = server.clone();
        async move {
            let mut conns = Vec::new();
            for _ in 0..n {
                let incoming = server
                    .accept()
                    .await
                    .context("server endpoint closed before every connection arrived")?;
                conns.push(incoming.await.context("server side of the handshake")?);
            }
            anyhow::Ok(conns)
        }
    });
    let mut client_conns = Vec::new();
    for client in &clients {
        client_conns.push(
            client
                .connect(server_addr, "localhost")
                .context("starting a connection")?
                .await
                .context("client side of the handshake")?,
        );
    }
    let server_conns = accept.await.context("accept task")??;

    let (user0, sys0) = cpu_times()?;
    let start = Instant::now();

    let (each, rest) = (args.bytes / u64::from(n), args.bytes % u64::from(n));
    let part = |i: usize| each + u64::from((i as u64) < rest);
    // Connections are accepted in any order: each receiver counts until
    // the total is reached across all of them.
    let counted_all = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stream_done = Arc::new(tokio::sync::Notify::new());
    let mut receivers = JoinSet::new();
    for c in &server_conns {
        receivers.spawn(receive(
            c.clone(),
            args.bytes,
            counted_all.clone(),
            stream_done.clone(),
        ));
    }
    let mut senders = JoinSet::new();
    for (i, c) in client_conns.iter().enumerate() {
        senders.spawn(send(c.clone(), part(i), args.streams, buf.clone()));
    }
    while let Some(r) = receivers.join_next().await {
        r.context("receiver task")??;
    }
    let counted = counted_all.load(std::sync::atomic::Ordering::Relaxed);
    ensure!(
        counted == args.bytes,
        "server counted {counted} bytes, expected {}",
        args.bytes
    );

    let wall = start.elapsed().as_secs_f64();
    let (user1, sys1) = cpu_times()?;

    while let Some(r) = senders.join_next().await {
        r.context("sender task")??;
    }
    for client_conn in &client_conns {
        client_conn.close(VarInt::from_u32(0), b"done");
    }
    for server_conn in &server_conns {
        match tokio::time::timeout(Duration::from_secs(10), server_conn.closed()).await {
            Ok(quinn::ConnectionError::ApplicationClosed(_)) => {}
            Ok(other) => bail!("connection ended unexpectedly: {other}"),
            Err(_) => bail!("the server did not see the close within 10 s"),
        }
    }
    for client in &clients {
        client.wait_idle().await;
    }
    server.wait_idle().await;

    let (cpu_user, cpu_sys) = (user1 - user0, sys1 - sys0);
    let cpu = cpu_user + cpu_sys;
    let cpu_per_gb = cpu / (counted as f64 / 1e9);
    let goodput_bps = counted as f64 * 8.0 / wall;

    eprintln!(
        "quinn-bare: {counted} bytes over {} connections x {} streams in {wall:.3} s ({:.3} Gbit/s); CPU {cpu:.3} s \
         (user {cpu_user:.3} s, sys {cpu_sys:.3} s) = {cpu_per_gb:.3} CPU-s per GB",
        args.connections,
        args.streams,
        goodput_bps / 1e9,
    );
    let report = Report {
        tool: "quinn",
        bytes: counted,
        wall_s: wall,
        cpu_user_s: cpu_user,
        cpu_sys_s: cpu_sys,
        cpu_s: cpu,
        connections: args.connections,
        cpu_s_per_gb: cpu_per_gb,
        goodput_bps,
    };
    println!(
        "{}",
        serde_json::to_string(&report).context("serialising the report")?
    );
    Ok(())
}
