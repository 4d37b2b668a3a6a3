//! A link served by several QUIC connections: chunks striped across them
//! arrive byte-identical, a connection lost mid-transfer loses nothing (a
//! data connection's chunks move to the others, the control connection's
//! loss resumes on a new pool), and pre-emption holds on every connection. In-process agents on the
//! in-memory emulated link (each connection on its own socket of it).
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use common::{pair_with, wait_published, write_dir, Pair};
use replicator::source::RootConfig;
use scheduler::{Class, Floors, Policy};

/// One test of this file at a time: each loads its own link, and they
/// would compete for the CPU.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Where the sink published source transfer `id`.
async fn replica_path(p: &Pair, id: ferry_proto::state::TransferId) -> PathBuf {
    let reps = p.sink.catalog().replicas(true, 100, 0).await.unwrap();
    let r = reps.iter().find(|r| r.source_transfer == id).unwrap();
    PathBuf::from(&r.local_path)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_over_four_connections_is_byte_identical() {
    let _serial = SERIAL.lock().await;
    let p = pair_with(0, |cfg| {
        cfg.links[0].connections = 4;
        cfg.streams = 2;
        cfg.batch_bytes = 256 << 10;
    })
    .await;
    let ckpt = p.root.join("step-1");
    write_dir(&ckpt, 6, 3 << 20);
    std::fs::write(ckpt.join(".metadata"), b"done").unwrap();
    let t = p.source.submit(&ckpt, None).await.unwrap();
    wait_published(&p, t.id).await;
    common::same_tree(&ckpt, &replica_path(&p, t.id).await);
    assert_eq!(
        p.source.link_connections("l"),
        Some(p.connections),
        "one pool of the configured connections, never replaced"
    );
    #[cfg(feature = "fault-injection")]
    {
        // Striped: every connection carried some of the chunks.
        let sent = p.source.sent_chunks("l");
        let used: HashSet<usize> = sent.iter().map(|c| c.connection).collect();
        let all: HashSet<usize> = (0..p.connections as usize).collect();
        assert_eq!(used, all, "connections used: {used:?}");
        let bytes: u64 = sent.iter().map(|c| c.bytes).sum();
        // The shards and the 4-byte marker.
        assert_eq!(bytes, (18 << 20) + 4, "each chunk sent once");
    }
}

/// The value of the metric line `name` (labels included) in Prometheus
/// text `text`.
#[cfg(feature = "fault-injection")]
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
}

/// A pair whose link `l` has four connections (200 Mbit/s, 2 writers
/// each, 256 KiB batches, `chunk_size`-byte chunks), connection `lose`
/// set to close after its 5th chunk, and checkpoint `name` (8 files of
/// 2 MiB, committed) submitted: the pair, the checkpoint and its
/// transfer row.
#[cfg(feature = "fault-injection")]
async fn four_connections_losing(
    lose: usize,
    chunk_size: u32,
    name: &str,
) -> (Pair, PathBuf, ferry_catalog::Transfer) {
    let p = pair_with(0, |cfg| {
        cfg.links[0].connections = 4;
        cfg.links[0].rate_bps = 200_000_000;
        cfg.streams = 2;
        cfg.batch_bytes = 256 << 10;
        cfg.chunk_size = chunk_size;
    })
    .await;
    assert!(p.source.close_connection_after("l", lose, 5));
    let ckpt = p.root.join(name);
    write_dir(&ckpt, 8, 2 << 20);
    std::fs::write(ckpt.join(".metadata"), b"done").unwrap();
    let t = p.source.submit(&ckpt, None).await.unwrap();
    (p, ckpt, t)
}

/// One connection of four, not the control one, closed after its 5th
/// chunk: the pool goes on with the other three. The chunks of its
/// batches the sink had not confirmed go back to the dispatcher and are
/// sent on the others; the transfer finishes on the same pool (no
/// connection is dialled again, where the whole pool used to be
/// replaced), its replica is byte-identical and every chunk matched its
/// hash on arrival.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_connection_lost_mid_transfer_moves_its_chunks_to_the_others() {
    let _serial = SERIAL.lock().await;
    let (p, ckpt, t) = four_connections_losing(2, 256 << 10, "step-2").await;
    // Between the loss and the end of the transfer, the pool goes on with
    // three of its four connections, and says so.
    let mut open_after_loss = None;
    for _ in 0..3000 {
        let pool = p.source.link_pool("l").unwrap();
        if pool.1 == 3 {
            let m = p.source.render_metrics().await.unwrap();
            open_after_loss = Some((pool, metric(&m, "ferry_link_connections{link=\"l\"}")));
            break;
        }
        let row = p.source.catalog().transfer(t.id).await.unwrap().unwrap();
        if row.state.is_final() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(
        open_after_loss,
        Some(((4, 3), 3.0)),
        "(connections, open) and the metric once one of four was lost"
    );
    wait_published(&p, t.id).await;
    common::same_tree(&ckpt, &replica_path(&p, t.id).await);
    assert_eq!(
        p.source.link_connections("l"),
        Some(4),
        "the pool was replaced after a connection other than the control one was lost"
    );
    let sent = p.source.sent_chunks("l");
    let on_lost = sent.iter().filter(|c| c.connection == 2).count();
    assert!(on_lost >= 5, "{on_lost} chunks on the lost connection");
    // The chunk whose write closed it was in a batch nobody had confirmed
    // yet: at least that one moved, and was sent again on another.
    let source_metrics = p.source.render_metrics().await.unwrap();
    let moved = metric(&source_metrics, "ferry_chunks_moved_total{link=\"l\"}");
    assert!(moved >= 1.0, "{moved} chunks moved");
    let bytes: u64 = sent.iter().map(|c| c.bytes).sum();
    assert!(
        bytes > (16 << 20) + 4,
        "the moved chunk was not sent again: {bytes} bytes sent"
    );
    let sink_metrics = p.sink.render_metrics().await.unwrap();
    assert_eq!(
        metric(&sink_metrics, "ferry_verification_failures_total"),
        0.0,
        "every chunk matched its hash"
    );
}

/// The control connection (the first of four) closed after its 5th chunk:
/// the transfers' opens and commits travel on it, so the pool is replaced
/// and the transfer resumes on the new one; its replica is byte-identical
/// (nothing lost, nothing published twice).
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_control_connection_lost_mid_transfer_resumes_on_a_new_pool() {
    let _serial = SERIAL.lock().await;
    let (p, ckpt, t) =
        four_connections_losing(0, ferry_proto::manifest::MIN_CHUNK_SIZE, "step-3").await;
    wait_published(&p, t.id).await;
    common::same_tree(&ckpt, &replica_path(&p, t.id).await);
    let n = p.source.link_connections("l").unwrap();
    assert!(
        n >= 2 * p.connections,
        "the pool was not replaced after its control connection was lost ({n} connections made)"
    );
    let sent = p.source.sent_chunks("l");
    assert!(sent.iter().filter(|c| c.connection == 0).count() >= 5);
}

/// Pre-emption on every connection (floors of 0, so background waits while
/// urgent has data): after a connection's first urgent chunk is handed to
/// quinn, at most one background chunk per stream writer of that
/// connection follows on it (the one each writer had already taken) until
/// the urgent transfer's last chunk is handed over. Counted at the sender.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn urgent_chunks_pre_empt_background_on_every_connection() {
    let _serial = SERIAL.lock().await;
    const STREAMS: usize = 2;
    let mut data = PathBuf::new();
    let p = pair_with(0, |cfg| {
        let base = cfg.roots[0]
            .path
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .to_path_buf();
        data = base.join("data");
        std::fs::create_dir_all(&data).unwrap();
        data = std::fs::canonicalize(&data).unwrap();
        cfg.roots.push(RootConfig {
            path: data.clone(),
            job: "archive".into(),
            link: "l".into(),
            watch: Default::default(),
        });
        cfg.links[0].rate_bps = 50_000_000;
        cfg.links[0].connections = 4;
        cfg.streams = STREAMS;
        cfg.chunk_size = 256 << 10;
        cfg.policy = Policy {
            floors: Floors {
                scheduled: 0.0,
                background: 0.0,
            },
            ..Policy::default()
        };
    })
    .await;
    // Background load, then an urgent checkpoint once it moves.
    let sets: Vec<PathBuf> = (0..3).map(|i| data.join(format!("set-{i}"))).collect();
    for d in &sets {
        write_dir(d, 4, 1 << 20);
    }
    let ckpt = p.root.join("step-100");
    write_dir(&ckpt, 4, 1 << 20);
    let mut load = Vec::new();
    for d in &sets {
        load.push(
            p.source
                .submit_as(d, None, Class::Background)
                .await
                .unwrap()
                .id,
        );
    }
    wait_moving(&p, &load).await;
    let t = p
        .source
        .submit_as(&ckpt, None, Class::Urgent)
        .await
        .unwrap();
    wait_published(&p, t.id).await;
    let sent = p.source.sent_chunks("l");
    let last_urgent = sent
        .iter()
        .rposition(|c| c.transfer == t.id)
        .expect("no urgent chunk was sent");
    let mut checked = 0;
    for conn in 0..p.connections as usize {
        let Some(first) = sent[..=last_urgent]
            .iter()
            .position(|c| c.connection == conn && c.class == Class::Urgent)
        else {
            continue;
        };
        checked += 1;
        let mut after: HashMap<usize, usize> = HashMap::new();
        for c in &sent[first + 1..last_urgent] {
            if c.connection == conn && c.class == Class::Background {
                *after.entry(c.writer).or_default() += 1;
            }
        }
        for (writer, n) in after {
            assert!(
                n <= 1,
                "connection {conn}, writer {writer}: {n} background chunks after its first urgent one"
            );
        }
    }
    assert!(
        checked >= 2,
        "urgent chunks went over {checked} connection(s) only"
    );
    for id in load {
        wait_published(&p, id).await;
    }
}

/// Waits (bounded) until the transfers `ids` have sent at least 2 MB.
async fn wait_moving(p: &Pair, ids: &[ferry_proto::state::TransferId]) {
    for _ in 0..800 {
        let sent: u64 = ids
            .iter()
            .filter_map(|id| p.source.progress(*id))
            .map(|g| g.bytes_sent)
            .sum();
        if sent >= 2 << 20 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the load never started moving");
}

/// Rewrites `file` in place with other bytes in its first 1,000 (and
/// `grow` more at its end), and an mtime one second later (a coarse file
/// system could otherwise keep the old one); returns the new bytes.
fn rewrite_head(file: &std::path::Path, grow: usize) -> Vec<u8> {
    rewrite_head_at(file, grow, Duration::from_secs(1))
}

/// [`rewrite_head`] with the old mtime plus `later` put back.
fn rewrite_head_at(file: &std::path::Path, grow: usize, later: Duration) -> Vec<u8> {
    let mtime = std::fs::metadata(file).unwrap().modified().unwrap();
    let mut b = std::fs::read(file).unwrap();
    for x in &mut b[..1000] {
        *x ^= 0xff;
    }
    b.extend(std::iter::repeat_n(7u8, grow));
    std::fs::write(file, &b).unwrap();
    std::fs::File::options()
        .write(true)
        .open(file)
        .unwrap()
        .set_modified(mtime + later)
        .unwrap();
    b
}

/// A pushed shard rewritten after all its chunks were sent, before the
/// commit: the source notices at the commit, sends the changed chunk again
/// (only that one) and the replica holds the final bytes.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_changed_after_it_was_sent_is_sent_again() {
    use replicator::hold::HoldPoint;
    let _serial = SERIAL.lock().await;
    let p = pair_with(0, |cfg| cfg.links[0].connections = 4).await;
    let ckpt = p.root.join("step-3");
    write_dir(&ckpt, 3, 1 << 20);
    let total = 3u64 << 20;
    let mut hold = p.source.hold_at(HoldPoint::Commit);
    let t = p.source.submit(&ckpt, None).await.unwrap();
    assert_eq!(hold.reached().await, Some(t.id));
    let sent_before = p.source.catalog().transfer(t.id).await.unwrap().unwrap();
    let now = rewrite_head(&ckpt.join("shard-1.bin"), 0);
    hold.release();
    let done = wait_published(&p, t.id).await;
    let replica = replica_path(&p, t.id).await;
    assert_eq!(std::fs::read(replica.join("shard-1.bin")).unwrap(), now);
    common::same_tree(&ckpt, &replica);
    let chunk = u64::from(ferry_proto::manifest::MIN_CHUNK_SIZE);
    assert!(
        sent_before.bytes_sent as u64 >= total,
        "all sent before the commit: {}",
        sent_before.bytes_sent
    );
    // The changed chunk goes again before the commit, and once more if its
    // stale copy, still in flight on another connection, reached the sink
    // after the new one (the commit's comparison asks for it); nothing
    // else goes again.
    let again = done.bytes_sent as u64 - total;
    assert!(
        again == chunk || again == 2 * chunk,
        "only the changed chunk went again: {again} bytes"
    );
}

/// A pushed shard rewritten in place with its size and mtime restored (as
/// `cp -p`, `rsync -a` or `touch -r` leave it): its version (the ctime,
/// on POSIX) still moved, so it is read and sent again.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_rewritten_with_its_mtime_restored_is_sent_again() {
    use replicator::hold::HoldPoint;
    let _serial = SERIAL.lock().await;
    let p = pair_with(0, |cfg| cfg.links[0].connections = 4).await;
    let ckpt = p.root.join("step-5");
    write_dir(&ckpt, 3, 1 << 20);
    let mut hold = p.source.hold_at(HoldPoint::Commit);
    let t = p.source.submit(&ckpt, None).await.unwrap();
    assert_eq!(hold.reached().await, Some(t.id));
    let f = ckpt.join("shard-0.bin");
    let before = std::fs::metadata(&f).unwrap().modified().unwrap();
    let now = rewrite_head_at(&f, 0, Duration::ZERO);
    assert_eq!(std::fs::metadata(&f).unwrap().modified().unwrap(), before);
    hold.release();
    wait_published(&p, t.id).await;
    let replica = replica_path(&p, t.id).await;
    assert_eq!(std::fs::read(replica.join("shard-0.bin")).unwrap(), now);
    common::same_tree(&ckpt, &replica);
}

/// A pushed shard that grew after it was sent: the sink's file table holds
/// the old size, so the run starts over, and the replica holds the final
/// bytes.
#[cfg(feature = "fault-injection")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_that_grew_after_it_was_sent_starts_the_run_over() {
    use replicator::hold::HoldPoint;
    let _serial = SERIAL.lock().await;
    let p = pair_with(0, |cfg| cfg.links[0].connections = 4).await;
    let ckpt = p.root.join("step-4");
    write_dir(&ckpt, 3, 1 << 20);
    let mut hold = p.source.hold_at(HoldPoint::Commit);
    let t = p.source.submit(&ckpt, None).await.unwrap();
    assert_eq!(hold.reached().await, Some(t.id));
    let now = rewrite_head(&ckpt.join("shard-2.bin"), 5000);
    hold.release();
    wait_published(&p, t.id).await;
    let replica = replica_path(&p, t.id).await;
    assert_eq!(std::fs::read(replica.join("shard-2.bin")).unwrap(), now);
    common::same_tree(&ckpt, &replica);
}

/// A sink that answers every hello with an older protocol version (one
/// not yet upgraded) is dialled at the backoff's pace, 250 ms doubling up
/// to 10 s, not every 250 ms: the backoff is reset only once the sink's
/// hello is accepted, not when the QUIC handshake succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_of_an_older_protocol_is_dialled_at_the_backoff_pace() {
    use ferry_proto::wire::{Control, Hello, PROTOCOL_VERSION};
    use replicator::source::Source;
    use replicator::transport::{self, SocketKind};
    use std::net::SocketAddr;
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    let certs = common::dev_pki(base);
    let (a, b): (SocketAddr, SocketAddr) =
        ("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
    let params = ferry_linkemu::LinkParams::new(1_000_000_000, Duration::from_millis(10));
    let (sa, sb) = ferry_linkemu::memory_pair(a, b, params.clone(), params);
    let server = quinn::ServerConfig::with_crypto(
        replicator::tls::server_crypto(&common::identity(&certs, "dst")).unwrap(),
    );
    let sink_ep = transport::endpoint(SocketKind::Memory(sb), Some(server)).unwrap();
    // The old sink: reads the hello, answers in version 3, keeps the
    // connection until the source closes it.
    let dials = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let d2 = dials.clone();
    tokio::spawn(async move {
        while let Some(inc) = sink_ep.accept().await {
            d2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tokio::spawn(async move {
                let Ok(conn) = inc.await else { return };
                let Ok((mut send, mut recv)) = conn.accept_bi().await else {
                    return;
                };
                let _ = replicator::conn::read_frame(&mut recv).await;
                let hello = Control::Hello(Hello {
                    version: PROTOCOL_VERSION - 1,
                    agent: "dst".into(),
                    site: "eval-b".into(),
                });
                let _ = send.write_all(&hello.encode()).await;
                conn.closed().await;
            });
        }
    });
    let root = common::job_root(base);
    let source = Source::start_with_sockets(
        common::source_config(&root, b),
        ferry_catalog::Catalog::open(&base.join("src-data"))
            .await
            .unwrap(),
        transport::endpoint(SocketKind::Memory(sa), None).unwrap(),
        None,
        &common::identity(&certs, "src"),
    )
    .unwrap();
    let ckpt = root.join("step-1");
    write_dir(&ckpt, 1, 4096);
    let t = source.submit(&ckpt, None).await.unwrap();
    // Dials at 0, 0.25, 0.75, 1.75 and 3.75 s (plus handshakes) at the
    // backoff's pace; every 250 ms or so before the fix.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let n = dials.load(std::sync::atomic::Ordering::Relaxed);
    assert!(n >= 2, "the source dialled the sink again: {n} dials");
    assert!(
        n <= 6,
        "the source redialled a sink it cannot talk to {n} times in 4 s"
    );
    let row = source.catalog().transfer(t.id).await.unwrap().unwrap();
    assert!(!row.state.is_final(), "it waits for the sink: {row:?}");
    source.shutdown(Duration::from_secs(5)).await;
}

/// A sink of the previous release refuses a hello of this release's
/// version, naming the versions it speaks (as every release's sink
/// words it): the source dials again in the newest of them, and keeps
/// speaking it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sink_of_the_previous_release_is_spoken_to_in_its_version() {
    use ferry_proto::wire::{Control, Hello, PROTOCOL_VERSION};
    use replicator::source::Source;
    use replicator::transport::{self, SocketKind};
    use std::net::SocketAddr;
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    let certs = common::dev_pki(base);
    let (a, b): (SocketAddr, SocketAddr) =
        ("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
    let params = ferry_linkemu::LinkParams::new(1_000_000_000, Duration::from_millis(10));
    let (sa, sb) = ferry_linkemu::memory_pair(a, b, params.clone(), params);
    let server = quinn::ServerConfig::with_crypto(
        replicator::tls::server_crypto(&common::identity(&certs, "dst")).unwrap(),
    );
    let sink_ep = transport::endpoint(SocketKind::Memory(sb), Some(server)).unwrap();
    let old = PROTOCOL_VERSION - 1;
    // The old sink: refuses a newer hello as it always has, answers one of
    // its own version, and records the versions it was greeted in.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    tokio::spawn(async move {
        while let Some(inc) = sink_ep.accept().await {
            let seen = s2.clone();
            tokio::spawn(async move {
                let Ok(conn) = inc.await else { return };
                let Ok((mut send, mut recv)) = conn.accept_bi().await else {
                    return;
                };
                let Ok(Some(Control::Hello(h))) = replicator::conn::read_frame(&mut recv).await
                else {
                    return;
                };
                seen.lock().unwrap().push(h.version);
                let answer = if h.version > old {
                    Control::Error {
                        message: format!(
                            "incompatible protocol version: peer speaks {}, this sink speaks 2 to {old}",
                            h.version
                        ),
                    }
                } else {
                    Control::Hello(Hello {
                        version: h.version,
                        agent: "dst".into(),
                        site: "eval-b".into(),
                    })
                };
                let _ = send.write_all(&answer.encode()).await;
                conn.closed().await;
            });
        }
    });
    let root = common::job_root(base);
    let source = Source::start_with_sockets(
        common::source_config(&root, b),
        ferry_catalog::Catalog::open(&base.join("src-data"))
            .await
            .unwrap(),
        transport::endpoint(SocketKind::Memory(sa), None).unwrap(),
        None,
        &common::identity(&certs, "src"),
    )
    .unwrap();
    let ckpt = root.join("step-1");
    write_dir(&ckpt, 1, 4096);
    source.submit(&ckpt, None).await.unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let v = seen.lock().unwrap().clone();
        if v.len() >= 2 {
            assert_eq!(v[0], PROTOCOL_VERSION, "{v:?}");
            assert!(v[1..].iter().all(|x| *x == old), "{v:?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the source did not dial again: {v:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    source.shutdown(Duration::from_secs(5)).await;
}

/// A further connection of the pool whose handshake fails (its socket
/// leads nowhere) is left out: the link works on the others instead of
/// failing every dial.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_further_connection_that_cannot_connect_is_left_out() {
    use replicator::source::Source;
    use replicator::transport::{self, SocketFactory, SocketKind};
    use std::net::SocketAddr;
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    let certs = common::dev_pki(base);
    let (a, b): (SocketAddr, SocketAddr) =
        ("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
    let params = ferry_linkemu::LinkParams::new(1_000_000_000, Duration::from_millis(10));
    let (sa, sb) = ferry_linkemu::memory_pair(a, b, params.clone(), params.clone());
    // A second emulated link with nothing at its far end.
    let (nowhere, _far) = ferry_linkemu::memory_pair(
        "10.0.9.1:1".parse().unwrap(),
        "10.0.9.2:2".parse().unwrap(),
        params.clone(),
        params,
    );
    let server = quinn::ServerConfig::with_crypto(
        replicator::tls::server_crypto(&common::identity(&certs, "dst")).unwrap(),
    );
    let sink_ep = transport::endpoint(SocketKind::Memory(sb), Some(server)).unwrap();
    let sink = common::start_sink(base, 0, sink_ep).await;
    let (first, next) = (sa.clone(), std::sync::atomic::AtomicU16::new(10));
    let sockets = SocketFactory::Custom(std::sync::Arc::new(move || {
        let port = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let s: std::sync::Arc<dyn quinn::AsyncUdpSocket> = if port == 11 {
            nowhere.sibling(SocketAddr::from(([10, 0, 9, 1], port)))?
        } else {
            first.sibling(SocketAddr::from(([10, 0, 0, 1], port)))?
        };
        Ok(s)
    }));
    let root = common::job_root(base);
    let mut cfg = common::source_config(&root, b);
    cfg.links[0].connections = 3;
    let source = Source::start_with_sockets(
        cfg,
        ferry_catalog::Catalog::open(&base.join("src-data"))
            .await
            .unwrap(),
        transport::endpoint(SocketKind::Memory(sa), None).unwrap(),
        Some(sockets),
        &common::identity(&certs, "src"),
    )
    .unwrap();
    let ckpt = root.join("step-1");
    write_dir(&ckpt, 3, 1 << 20);
    let t = source.submit(&ckpt, None).await.unwrap();
    // The failing handshake takes the idle timeout (10 s) to give up.
    let done = common::published_by(&source, t.id).await;
    assert_eq!(done.state.as_str(), "published");
    assert_eq!(
        source.link_connections("l"),
        Some(2),
        "the pool is the two connections that connected"
    );
    let reps = sink.catalog().replicas(true, 100, 0).await.unwrap();
    let r = reps.iter().find(|r| r.source_transfer == t.id).unwrap();
    common::same_tree(&ckpt, std::path::Path::new(&r.local_path));
    source.shutdown(Duration::from_secs(5)).await;
}
