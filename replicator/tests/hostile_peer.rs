//! A hand-driven source that sends what a real one never would: paths that
//! escape the sink root, oversized lengths, a wrong protocol version. The
//! sink must refuse each, close the connection where the protocol is
//! broken, and write nothing outside its root.
#![allow(clippy::unwrap_used, missing_docs)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ferry_catalog::Catalog;
use ferry_proto::limits::MAX_CHUNK;
use ferry_proto::manifest::FileInfo;
use ferry_proto::state::TransferId;
use ferry_proto::wire::{
    BatchHeader, CheckpointInfo, Commit, Control, Hello, Open, RecordHeader, TransferKey,
    BATCH_SEQ_VERSION, MIN_PROTOCOL_VERSION, PROTOCOL_VERSION,
};
use quinn::{Connection, Endpoint};
use replicator::conn::read_frame;
use replicator::sink::retention::RetentionPolicy;
use replicator::sink::{Sink, SinkConfig};
use replicator::tls::{self, AgentIdentity};
use replicator::transport::{self, SocketKind};

struct Setup {
    _dir: tempfile::TempDir,
    base: std::path::PathBuf,
    sink_root: std::path::PathBuf,
    sink_addr: SocketAddr,
    client: Endpoint,
    /// Another source agent of the same site and catalog (its own
    /// certificate, so the sink tells the two apart).
    helper: Endpoint,
    _sink: Sink,
}

async fn setup() -> Setup {
    setup_with(Vec::new()).await
}

/// [`setup`] with the sink's retention policies.
async fn setup_with(retention: Vec<RetentionPolicy>) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_path_buf();
    let certs = base.join("certs");
    tls::init_dev_pki(
        &certs,
        &["evil-src".into(), "helper-src".into(), "sink-1".into()],
        2,
    )
    .unwrap();
    let id = |n: &str| {
        AgentIdentity::load(
            &certs.join("ca.pem"),
            &certs.join(format!("{n}.pem")),
            &certs.join(format!("{n}.key")),
        )
        .unwrap()
    };
    let sink_id = id("sink-1");
    let server = quinn::ServerConfig::with_crypto(tls::server_crypto(&sink_id).unwrap());
    let ep = transport::endpoint(
        SocketKind::Udp("127.0.0.1:0".parse().unwrap()),
        Some(server),
    )
    .unwrap();
    let sink_addr = ep.local_addr().unwrap();
    let sink_root = base.join("eval");
    let catalog = Catalog::open(&base.join("sink-data")).await.unwrap();
    let sink = Sink::start(
        SinkConfig {
            agent: "sink-1".into(),
            site: "eval-b".into(),
            root: sink_root.clone(),
            storage: Default::default(),
            accept_peers: vec![],
            reserve_bytes: 0,
            reread_before_publish: true,
            retention,
            retention_interval: std::time::Duration::from_secs(3600),
            pressure: None,
            pool: None,
        },
        catalog,
        ep,
    )
    .unwrap();
    let mut client =
        transport::endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
    client.set_default_client_config(quinn::ClientConfig::new(
        tls::client_crypto(&id("evil-src")).unwrap(),
    ));
    let mut helper =
        transport::endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
    helper.set_default_client_config(quinn::ClientConfig::new(
        tls::client_crypto(&id("helper-src")).unwrap(),
    ));
    Setup {
        _dir: dir,
        base,
        sink_root,
        sink_addr,
        client,
        helper,
        _sink: sink,
    }
}

async fn connect(
    s: &Setup,
    version: u16,
) -> (
    Connection,
    quinn::SendStream,
    quinn::RecvStream,
    Option<Control>,
) {
    connect_from(s, &s.client, version).await
}

/// [`connect`] from `client` (`s.client` or `s.helper`).
async fn connect_from(
    s: &Setup,
    client: &Endpoint,
    version: u16,
) -> (
    Connection,
    quinn::SendStream,
    quinn::RecvStream,
    Option<Control>,
) {
    let conn = client
        .connect(s.sink_addr, "sink-1")
        .unwrap()
        .await
        .unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let hello = Control::Hello(Hello {
        version,
        agent: "evil-src".into(),
        site: "train-a".into(),
    });
    send.write_all(&hello.encode()).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), read_frame(&mut recv))
        .await
        .unwrap()
        .ok()
        .flatten();
    (conn, send, recv, answer)
}

fn open(id: u64, rel: &str, files: Vec<FileInfo>) -> Control {
    let bytes_total = files.iter().fold(0u64, |a, f| a.saturating_add(f.size));
    Control::Open(Open {
        key: TransferKey {
            id: TransferId(id),
            job: "job".into(),
            source_path: format!("/ckpt/job/{rel}"),
            rel: rel.into(),
            profile: ferry_proto::state::Profile::Full,
            origin: None,
        },
        chunk_size: 4 << 20,
        bytes_total,
        files,
        parts_first: false,
        joins: false,
    })
}

fn file(path: &str, size: u64) -> FileInfo {
    FileInfo {
        path: path.into(),
        size,
        mode: 0o644,
        mtime_ns: 0,
    }
}

/// The commit of transfer `id` whose manifest holds one file `a` of
/// `payload` (one chunk), after `batches` batches.
fn commit_of(id: u64, payload: &[u8], batches: u64) -> Control {
    let manifest = ferry_proto::manifest::Manifest {
        chunk_size: 4 << 20,
        files: vec![ferry_proto::manifest::FileEntry {
            path: "a".into(),
            size: payload.len() as u64,
            mode: 0o644,
            mtime_ns: 0,
            chunks: vec![*blake3::hash(payload).as_bytes()],
        }],
        markers: vec![],
    };
    manifest.validate().unwrap();
    Control::Commit(commit_with(id, manifest, batches))
}

/// The commit of transfer `id` sealing `manifest` after `batches`
/// batches, with nothing else set.
fn commit_with(id: u64, manifest: ferry_proto::manifest::Manifest, batches: u64) -> Commit {
    Commit {
        id: TransferId(id),
        committed_ms: 0,
        opened_ms: 0,
        batches,
        manifest,
        siblings: vec![],
        checkpoint: None,
        lost: vec![],
        phases: Default::default(),
        weights_only: false,
    }
}

/// Every regular file under `dir`, relative.
fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p.strip_prefix(dir).unwrap().to_string_lossy().into_owned());
            }
        }
    }
    out
}

#[tokio::test]
async fn escaping_paths_are_refused_and_nothing_lands_outside_the_root() {
    let s = setup().await;
    let (_conn, mut send, mut recv, answer) = connect(&s, PROTOCOL_VERSION).await;
    assert!(matches!(answer, Some(Control::Hello(_))), "{answer:?}");
    let cases = [
        open(1, "ok", vec![file("../x", 5)]),
        open(2, "ok", vec![file("/etc/evil", 5)]),
        open(3, "ok", vec![file("a\0b", 5)]),
        open(4, "../../escape", vec![file("x", 5)]),
        open(5, "/abs", vec![file("x", 5)]),
        open(6, "ok", vec![file("a", 5), file("a/b", 5)]),
    ];
    for (i, msg) in cases.iter().enumerate() {
        send.write_all(&msg.encode()).await.unwrap();
        let reply = read_frame(&mut recv).await.unwrap().unwrap();
        match reply {
            Control::Refuse { id, reason } => {
                assert_eq!(id, TransferId(i as u64 + 1));
                assert!(!reason.is_empty());
            }
            other => panic!("case {i}: expected refuse, got {other:?}"),
        }
    }
    // The job name is also a path component.
    let mut bad_job = open(7, "ok", vec![file("x", 5)]);
    if let Control::Open(Open { key, .. }) = &mut bad_job {
        key.job = "..".into();
    }
    send.write_all(&bad_job.encode()).await.unwrap();
    assert!(matches!(
        read_frame(&mut recv).await.unwrap(),
        Some(Control::Refuse { .. })
    ));
    let outside: Vec<_> = files_under(&s.base)
        .into_iter()
        .filter(|p| {
            !p.starts_with("eval/") && !p.starts_with("certs/") && !p.starts_with("sink-data/")
        })
        .collect();
    assert!(
        outside.is_empty(),
        "written outside the sink root: {outside:?}"
    );
    assert!(files_under(&s.sink_root).is_empty());
}

#[tokio::test]
async fn oversized_record_closes_the_connection() {
    let s = setup().await;
    let (conn, mut send, mut recv, _) = connect(&s, PROTOCOL_VERSION).await;
    send.write_all(&open(1, "step", vec![file("a", 10)]).encode())
        .await
        .unwrap();
    assert!(matches!(
        read_frame(&mut recv).await.unwrap(),
        Some(Control::Have { .. })
    ));
    let mut data = conn.open_uni().await.unwrap();
    data.write_all(
        &BatchHeader {
            transfer: TransferId(1),
            seq: Some(0),
        }
        .encode(),
    )
    .await
    .unwrap();
    let h = RecordHeader {
        file: 0,
        chunk: 0,
        len: MAX_CHUNK + 1,
        hash: [0; 32],
    };
    data.write_all(&h.encode()).await.unwrap();
    let _ = data.finish();
    let closed = tokio::time::timeout(Duration::from_secs(10), conn.closed())
        .await
        .unwrap();
    assert!(closed.to_string().contains("chunk length"), "{closed}");
    assert!(files_under(&s.sink_root).is_empty());
}

#[tokio::test]
async fn huge_control_frame_closes_the_connection() {
    let s = setup().await;
    let (conn, mut send, _recv, _) = connect(&s, PROTOCOL_VERSION).await;
    send.write_all(&u32::MAX.to_be_bytes()).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(10), conn.closed())
        .await
        .unwrap();
    assert!(closed.to_string().contains("frame length"), "{closed}");
}

#[tokio::test]
async fn wrong_protocol_version_gets_a_clear_error() {
    let s = setup().await;
    let (_conn, _send, _recv, answer) = connect(&s, 99).await;
    match answer {
        Some(Control::Error { message }) => {
            assert!(
                message.contains("99") && message.contains(&PROTOCOL_VERSION.to_string()),
                "{message}"
            )
        }
        other => panic!("expected an error naming both versions, got {other:?}"),
    }
}

/// A batch that reaches the sink after its transfer was cancelled (a
/// source cancels a transfer whose first batch is on its way) is stopped
/// at once; the connection is not closed and no staging data comes back.
#[tokio::test]
async fn a_batch_after_its_cancel_is_dropped_and_the_connection_lives() {
    let s = setup().await;
    let (conn, mut send, mut recv, _) = connect(&s, PROTOCOL_VERSION).await;
    send.write_all(&open(1, "step", vec![file("a", 10)]).encode())
        .await
        .unwrap();
    assert!(matches!(
        read_frame(&mut recv).await.unwrap(),
        Some(Control::Have { .. })
    ));
    send.write_all(
        &Control::Cancel {
            id: TransferId(1),
            reason: "cancelled by an operator".into(),
        }
        .encode(),
    )
    .await
    .unwrap();
    // Let the cancel land first, as it does when control frames overtake
    // data.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut data = conn.open_uni().await.unwrap();
    data.write_all(
        &BatchHeader {
            transfer: TransferId(1),
            seq: Some(0),
        }
        .encode(),
    )
    .await
    .unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(3), data.stopped())
        .await
        .expect("the sink neither stopped the batch nor closed within 3 s");
    assert!(stopped.is_ok(), "{stopped:?}");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(conn.close_reason().is_none(), "{:?}", conn.close_reason());
    let staged: Vec<String> = files_under(&s.sink_root)
        .into_iter()
        .filter(|f| f.contains("1-"))
        .collect();
    assert!(staged.is_empty(), "{staged:?}");
}

/// The sink's next answer on `recv` other than a batch confirmation, and
/// the batches confirmed before it, sorted.
async fn answer_after_confirmations(recv: &mut quinn::RecvStream) -> (Option<Control>, Vec<u64>) {
    let mut done = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(20), read_frame(recv))
            .await
            .expect("no answer from the sink within 20 s")
            .unwrap();
        match m {
            Some(Control::BatchDone { seqs, .. }) => done.extend(seqs),
            other => {
                done.sort_unstable();
                return (other, done);
            }
        }
    }
}

/// Waits for the sink to close `conn` and returns the close reason.
async fn closed_reason(conn: &Connection) -> String {
    tokio::time::timeout(Duration::from_secs(20), conn.closed())
        .await
        .expect("the sink did not close the connection within 20 s")
        .to_string()
}

/// Every regular file or symlink under `base` that is outside the sink
/// root and the test's own certificate and catalog directories.
fn outside_root(s: &Setup) -> Vec<String> {
    files_under(&s.base)
        .into_iter()
        .filter(|p| {
            !p.starts_with("eval/") && !p.starts_with("certs/") && !p.starts_with("sink-data/")
        })
        .collect()
}

/// The one staging directory of the sink (after one open).
fn staging_dir(s: &Setup) -> std::path::PathBuf {
    let dirs: Vec<_> = std::fs::read_dir(s.sink_root.join(".ferry/staging"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs.into_iter().next().unwrap()
}

/// Sends one batch holding one record: batch `seq` of `transfer` (the
/// sequence number only from a version 4 source, `version`).
#[allow(clippy::too_many_arguments)]
async fn send_record(
    conn: &Connection,
    version: u16,
    transfer: u64,
    seq: u64,
    file: u32,
    chunk: u32,
    payload: &[u8],
) {
    let mut data = conn.open_uni().await.unwrap();
    data.write_all(
        &BatchHeader {
            transfer: TransferId(transfer),
            seq: (version >= BATCH_SEQ_VERSION).then_some(seq),
        }
        .encode(),
    )
    .await
    .unwrap();
    let h = RecordHeader {
        file,
        chunk,
        len: payload.len() as u32,
        hash: *blake3::hash(payload).as_bytes(),
    };
    data.write_all(&h.encode()).await.unwrap();
    data.write_all(payload).await.unwrap();
    let _ = data.finish();
    // Wait until the sink has consumed the stream (or closed it).
    let _ = tokio::time::timeout(Duration::from_secs(20), data.stopped()).await;
}

/// Out-of-order and unexpected control messages after the handshake: each
/// closes the connection with a reason naming the problem.
#[tokio::test]
async fn out_of_order_control_messages_close_the_connection() {
    let s = setup().await;
    let manifest = ferry_proto::manifest::Manifest {
        chunk_size: 4 << 20,
        files: vec![],
        markers: vec![],
    };
    let cases: Vec<(Control, &str)> = vec![
        (
            Control::Hello(Hello {
                version: PROTOCOL_VERSION,
                agent: "evil-src".into(),
                site: "train-a".into(),
            }),
            "unexpected hello",
        ),
        (
            Control::Commit(commit_with(77, manifest, 0)),
            "commit for unknown transfer 77",
        ),
        // Messages only a sink sends.
        (
            Control::Have {
                id: TransferId(1),
                chunks: vec![0],
            },
            "unexpected have",
        ),
        (
            Control::Published {
                id: TransferId(1),
                local_path: "/etc".into(),
                root: [0; 32],
                phases: Default::default(),
            },
            "unexpected published",
        ),
        (
            Control::BatchDone {
                id: TransferId(1),
                seqs: vec![0],
            },
            "unexpected batch-done",
        ),
    ];
    for (msg, want) in cases {
        let (conn, mut send, _recv, answer) = connect(&s, PROTOCOL_VERSION).await;
        assert!(matches!(answer, Some(Control::Hello(_))), "{answer:?}");
        send.write_all(&msg.encode()).await.unwrap();
        let reason = closed_reason(&conn).await;
        assert!(reason.contains(want), "{}: {reason}", msg.name());
    }
    // A first message that is not a hello.
    let conn = s
        .client
        .connect(s.sink_addr, "sink-1")
        .unwrap()
        .await
        .unwrap();
    let (mut send, _recv) = conn.open_bi().await.unwrap();
    send.write_all(&open(1, "step", vec![file("a", 10)]).encode())
        .await
        .unwrap();
    let reason = closed_reason(&conn).await;
    assert!(reason.contains("expected hello, got open"), "{reason}");
    assert!(outside_root(&s).is_empty(), "{:?}", outside_root(&s));
    assert!(files_under(&s.sink_root).is_empty());
}

/// A part registered for a transfer the source never opened closes the
/// connection, naming it; nothing is recorded or written.
#[tokio::test]
async fn a_part_of_a_transfer_never_opened_closes_the_connection() {
    let s = setup().await;
    let (conn, mut send, _recv, _) = connect(&s, PROTOCOL_VERSION).await;
    let part = Control::Part {
        id: TransferId(77),
        part: 0,
        epoch: 1,
        first_key: 0,
        end_key: 4,
    };
    send.write_all(&part.encode()).await.unwrap();
    let reason = closed_reason(&conn).await;
    assert!(
        reason.contains("a part of transfer 77, which this connection's source never opened"),
        "{reason}"
    );
    assert!(outside_root(&s).is_empty(), "{:?}", outside_root(&s));
    assert!(files_under(&s.sink_root).is_empty());
}

/// Bytes that are no message at all: an unknown control message type, and
/// a data stream without the magic bytes.
#[tokio::test]
async fn unknown_message_types_close_the_connection() {
    let s = setup().await;
    for ty in [0u8, 15, 200, 255] {
        let (conn, mut send, _recv, _) = connect(&s, PROTOCOL_VERSION).await;
        let mut frame = 9u32.to_be_bytes().to_vec();
        frame.push(ty);
        frame.extend_from_slice(&1u64.to_be_bytes());
        send.write_all(&frame).await.unwrap();
        let reason = closed_reason(&conn).await;
        assert!(
            reason.contains(&format!("unknown control message type {ty}")),
            "{reason}"
        );
    }
    let (conn, _send, _recv, _) = connect(&s, PROTOCOL_VERSION).await;
    let mut data = conn.open_uni().await.unwrap();
    data.write_all(b"GET / HTTP/1.1\r\nHost: sink\r\n\r\n")
        .await
        .unwrap();
    let _ = data.finish();
    let reason = closed_reason(&conn).await;
    assert!(reason.contains("magic bytes"), "{reason}");
    assert!(files_under(&s.sink_root).is_empty());
}

/// Data for a transfer that was never opened is refused and closes the
/// connection once the sink stops waiting for the open (10 s).
#[tokio::test]
async fn data_for_a_transfer_never_opened_closes_the_connection() {
    let s = setup().await;
    let (conn, _send, _recv, _) = connect(&s, PROTOCOL_VERSION).await;
    let c2 = conn.clone();
    tokio::spawn(async move { send_record(&c2, PROTOCOL_VERSION, 42, 0, 0, 0, b"hello").await });
    let reason = closed_reason(&conn).await;
    assert!(
        reason.contains("transfer 42 which was never opened"),
        "{reason}"
    );
    assert!(files_under(&s.sink_root).is_empty());
    assert!(outside_root(&s).is_empty());
}

/// Records outside the declared file table (a chunk past the end of a
/// file, a chunk longer than the file, a file index never announced) are
/// dropped unwritten; the transfer is not harmed and still completes with
/// the right bytes.
#[tokio::test]
async fn records_past_the_declared_file_size_are_dropped() {
    let s = setup().await;
    let (conn, mut send, mut recv, _) = connect(&s, PROTOCOL_VERSION).await;
    send.write_all(&open(1, "step", vec![file("a", 10)]).encode())
        .await
        .unwrap();
    assert!(matches!(
        read_frame(&mut recv).await.unwrap(),
        Some(Control::Have { .. })
    ));
    // In parallel: each waits up to 10 s for a file-table update.
    let v = PROTOCOL_VERSION;
    tokio::join!(
        send_record(&conn, v, 1, 0, 0, 1, &[7u8; 10]),
        send_record(&conn, v, 1, 1, 0, 0, &[7u8; 100]),
        send_record(&conn, v, 1, 2, 5, 0, &[7u8; 10]),
    );
    assert!(conn.close_reason().is_none(), "{:?}", conn.close_reason());
    let staged = staging_dir(&s).join("a");
    assert!(
        !staged.exists() || std::fs::metadata(&staged).unwrap().len() <= 10,
        "bytes past the declared size were written"
    );
    // The honest record completes the transfer.
    let payload = b"0123456789";
    send_record(&conn, v, 1, 3, 0, 0, payload).await;
    send.write_all(&commit_of(1, payload, 4).encode())
        .await
        .unwrap();
    let (reply, done) = answer_after_confirmations(&mut recv).await;
    let Some(Control::Published { local_path, .. }) = reply else {
        panic!("expected published, got {reply:?}");
    };
    // Every batch was confirmed, the ones with dropped records too.
    assert_eq!(done, [0, 1, 2, 3]);
    let published = std::fs::read(Path::new(&local_path).join("a")).unwrap();
    assert_eq!(published, payload);
    assert!(Path::new(&local_path).starts_with(&s.sink_root));
    assert!(outside_root(&s).is_empty(), "{:?}", outside_root(&s));
}

/// Opens transfer `n` (checkpoint `step_<n>`, one 10-byte file) on a new
/// connection speaking `version`, sends its chunk and commits with
/// `checkpoint`; returns the published local path.
async fn publish_raw(
    s: &Setup,
    n: u64,
    version: u16,
    checkpoint: Option<CheckpointInfo>,
) -> String {
    publish_at(s, n, &format!("step_{n}"), version, checkpoint).await
}

/// The source catalog id a version 5 source sends in [`publish_at`].
const ORIGIN: &str = "00112233445566778899aabbccddeeff";

/// [`publish_raw`] of checkpoint `rel`.
async fn publish_at(
    s: &Setup,
    n: u64,
    rel: &str,
    version: u16,
    checkpoint: Option<CheckpointInfo>,
) -> String {
    let (conn, mut send, mut recv, answer) = connect(s, version).await;
    match answer {
        Some(Control::Hello(h)) => assert_eq!(h.version, version),
        other => panic!("version {version}: expected a hello, got {other:?}"),
    }
    let mut o = open(n, rel, vec![file("a", 10)]);
    if version >= ferry_proto::wire::ORIGIN_VERSION {
        if let Control::Open(op) = &mut o {
            op.key.origin = Some(ORIGIN.into());
        }
    }
    send.write_all(&o.encode()).await.unwrap();
    assert!(matches!(
        read_frame(&mut recv).await.unwrap(),
        Some(Control::Have { .. })
    ));
    let payload = b"abcdefghij";
    send_record(&conn, version, n, 0, 0, 0, payload).await;
    let m = ferry_proto::manifest::Manifest {
        chunk_size: 4 << 20,
        files: vec![ferry_proto::manifest::FileEntry {
            path: "a".into(),
            size: 10,
            mode: 0o644,
            mtime_ns: 0,
            chunks: vec![*blake3::hash(payload).as_bytes()],
        }],
        markers: vec![],
    };
    send.write_all(
        &Control::Commit(Commit {
            checkpoint,
            ..commit_with(n, m, 1)
        })
        .encode(),
    )
    .await
    .unwrap();
    let (reply, done) = answer_after_confirmations(&mut recv).await;
    let Some(Control::Published { local_path, .. }) = reply else {
        panic!("version {version}: expected published, got {reply:?}");
    };
    // Only a version 4 source hears about its batches.
    let want: &[u64] = if version >= BATCH_SEQ_VERSION {
        &[0]
    } else {
        &[]
    };
    assert_eq!(done, want, "version {version}");
    assert_eq!(
        std::fs::read(Path::new(&local_path).join("a")).unwrap(),
        payload
    );
    conn.close(0u32.into(), b"done");
    local_path
}

/// Sources of the older protocol versions (version 2: no step or class at
/// commit; version 3: no batch sequence numbers) still publish; a current
/// one's step and class are stored with the replica and its batch is
/// confirmed, and its transfer is keyed by its catalog's id. The sink answers each hello in the source's own version.
#[tokio::test]
async fn an_old_version_source_still_publishes_and_a_new_one_sends_step_and_class() {
    let s = setup().await;
    let old = publish_raw(&s, 1, MIN_PROTOCOL_VERSION, None).await;
    let v3 = publish_raw(
        &s,
        3,
        3,
        Some(CheckpointInfo {
            step: Some(3),
            class: "background".into(),
            readers: None,
        }),
    )
    .await;
    let info = CheckpointInfo {
        step: Some(1200),
        class: "urgent".into(),
        readers: None,
    };
    let new = publish_raw(&s, 2, PROTOCOL_VERSION, Some(info)).await;
    let cat = s._sink.catalog();
    let row = async |p: String| cat.replica_by_local_path(&p).await.unwrap().unwrap();
    let old = row(old).await;
    assert_eq!((old.step, old.class), (None, None));
    let v3 = row(v3).await;
    assert_eq!(
        (v3.step, v3.class),
        (Some(3), Some(scheduler::Class::Background))
    );
    let new = row(new).await;
    assert_eq!(
        (new.step, new.class),
        (Some(1200), Some(scheduler::Class::Urgent))
    );
    // A version 5 source's transfer is keyed by its catalog, an older
    // one's by the agent that sent it.
    assert_eq!(new.peer, format!("catalog:{ORIGIN}"));
    assert!(!v3.peer.starts_with("catalog:"), "{v3:?}");
}

/// A recorded session of a source of the previous release (protocol 4,
/// written by that release's own codec: `tests/fixtures/protocol-4/`),
/// replayed byte for byte: the current sink answers in version 4,
/// confirms the batch and publishes the checkpoint with its modes,
/// mtimes, sibling marker, step and class; the transfer is keyed by the
/// sending agent (a version 4 open names no source catalog).
#[tokio::test]
async fn a_recorded_protocol_4_source_session_still_publishes() {
    let s = setup().await;
    let fx = |n: &str| {
        let p = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/protocol-4")
            .join(n);
        std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    };
    let conn = s
        .client
        .connect(s.sink_addr, "sink-1")
        .unwrap()
        .await
        .unwrap();
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    send.write_all(&fx("hello.bin")).await.unwrap();
    match read_frame(&mut recv).await.unwrap() {
        Some(Control::Hello(h)) => assert_eq!(h.version, 4),
        other => panic!("expected a version 4 hello, got {other:?}"),
    }
    send.write_all(&fx("open.bin")).await.unwrap();
    assert!(matches!(
        read_frame(&mut recv).await.unwrap(),
        Some(Control::Have { .. })
    ));
    let mut data = conn.open_uni().await.unwrap();
    data.write_all(&fx("batch.bin")).await.unwrap();
    let _ = data.finish();
    let _ = tokio::time::timeout(Duration::from_secs(20), data.stopped()).await;
    send.write_all(&fx("commit.bin")).await.unwrap();
    let (reply, done) = answer_after_confirmations(&mut recv).await;
    let Some(Control::Published { local_path, .. }) = reply else {
        panic!("expected published, got {reply:?}");
    };
    assert_eq!(done, [0]);
    let dir = Path::new(&local_path);
    assert!(dir.ends_with("train-a/job/step_4"), "{local_path}");
    let b: Vec<u8> = (0..3000u32).map(|i| (i * 7 % 251) as u8).collect();
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    for (name, bytes, mode, mtime) in [
        (
            "a",
            b"abcdefghij".to_vec(),
            0o644,
            1_700_000_000_123_456_789i64,
        ),
        ("sub/b", b, 0o600, 1_700_000_000_123_456_790),
    ] {
        let p = dir.join(name);
        assert_eq!(std::fs::read(&p).unwrap(), bytes, "{name}");
        let md = std::fs::metadata(&p).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, mode, "{name}");
        assert_eq!(
            md.mtime() * 1_000_000_000 + md.mtime_nsec(),
            mtime,
            "{name}"
        );
    }
    assert_eq!(
        std::fs::read(dir.parent().unwrap().join("latest")).unwrap(),
        b"step_4"
    );
    let row = s
        ._sink
        .catalog()
        .replica_by_local_path(&local_path)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (row.step, row.class),
        (Some(4), Some(scheduler::Class::Scheduled))
    );
    assert!(!row.peer.starts_with("catalog:"), "{row:?}");
    conn.close(0u32.into(), b"done");
}

/// Removal by hand refuses, naming why and removing nothing: an unknown
/// id, a version a re-save replaced, a pinned one without force.
#[tokio::test]
async fn a_removal_by_hand_refuses_what_it_cannot_remove() {
    use replicator::sink::lifecycle::LifecycleError;
    let s = setup().await;
    let path = publish_at(&s, 1, "step_7", PROTOCOL_VERSION, None).await;
    // The job saves step 7 again: a new transfer, the same path.
    let again = publish_at(&s, 2, "step_7", PROTOCOL_VERSION, None).await;
    assert_eq!(path, again);
    let rows = s._sink.catalog().replicas_in(None, 10, 0).await.unwrap();
    let (new, old) = (rows[0].id, rows[1].id);
    match s._sink.remove(999, false, "").await {
        Err(e @ LifecycleError::NotFound(999)) => assert_eq!(e.to_string(), "no replica 999"),
        other => panic!("{other:?}"),
    }
    match s._sink.remove(old, false, "").await {
        Err(e @ LifecycleError::Replaced { .. }) => {
            assert!(
                e.to_string()
                    .contains(&format!("replaced by replica {new}")),
                "{e}"
            )
        }
        other => panic!("{other:?}"),
    }
    // Nor is a pin on it taken: it would protect nothing.
    match s._sink.pin(old, None, "keep").await {
        Err(LifecycleError::Replaced { by, .. }) => assert_eq!(by, new),
        other => panic!("{other:?}"),
    }
    s._sink.pin(new, None, "keep").await.unwrap();
    match s._sink.remove(new, false, "").await {
        Err(e @ LifecycleError::Pinned { .. }) => assert!(e.to_string().contains("keep"), "{e}"),
        other => panic!("{other:?}"),
    }
    assert!(Path::new(&path).join("a").exists(), "nothing was removed");
    let r = s._sink.remove(new, true, "").await.unwrap();
    // Its files are deleted in the background, which may already be
    // done by the time the row is read back.
    assert!(
        matches!(
            r.state,
            ferry_proto::state::TransferState::Removing
                | ferry_proto::state::TransferState::Removed
        ),
        "{r:?}"
    );
    assert!(r.removal.unwrap().forced);
    assert!(!Path::new(&path).exists());
    // Removed now: a second removal is refused.
    assert!(matches!(
        s._sink.remove(new, true, "").await,
        Err(LifecycleError::NotPublished { .. })
    ));
}

/// A `dry_run` policy names what it would remove and removes nothing; the
/// same policy without `dry_run` removes it (out of the published
/// namespace at once, its files deleted in the background).
#[tokio::test]
async fn a_dry_run_policy_removes_nothing() {
    for dry_run in [true, false] {
        let policy = RetentionPolicy::new("job", Some(1), None, None, None, dry_run).unwrap();
        let s = setup_with(vec![policy]).await;
        let info = |step| CheckpointInfo {
            step: Some(step),
            class: "scheduled".into(),
            readers: None,
        };
        let older = publish_raw(&s, 1, PROTOCOL_VERSION, Some(info(100))).await;
        let newer = publish_raw(&s, 2, PROTOCOL_VERSION, Some(info(200))).await;
        let cat = s._sink.catalog();
        // By rel: the pass after the publish may have removed it already.
        let older_id = cat
            .replicas_in(None, 10, 0)
            .await
            .unwrap()
            .into_iter()
            .find(|r| r.rel == "step_1")
            .unwrap()
            .id;
        if dry_run {
            assert_eq!(s._sink.apply_retention().await.unwrap(), vec![older_id]);
            assert!(Path::new(&older).join("a").exists());
            assert!(cat.replica_by_local_path(&older).await.unwrap().is_some());
            let r = s._sink.resolve("/ckpt/job/step_1").await.unwrap();
            assert!(
                matches!(r, replicator::sink::Resolution::Local { .. }),
                "{r:?}"
            );
        } else {
            // The pass after the publish may have been first: either way
            // the row ends `removed`.
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                s._sink.apply_retention().await.unwrap();
                let r = cat.replica(older_id).await.unwrap().unwrap();
                if r.state == ferry_proto::state::TransferState::Removed {
                    assert_eq!(
                        r.removal.unwrap().reason,
                        ferry_catalog::RemovalReason::Rule
                    );
                    break;
                }
                assert!(std::time::Instant::now() < deadline, "{r:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert!(!Path::new(&older).exists(), "out of the published path");
            let r = s._sink.resolve("/ckpt/job/step_1").await.unwrap();
            assert!(
                matches!(r, replicator::sink::Resolution::Remote { .. }),
                "{r:?}"
            );
        }
        assert!(Path::new(&newer).join("a").exists());
    }
}

/// A symlink planted in a transfer's staging directory, at a file's name or
/// at one of its parent directories, pointing outside the sink root: the
/// sink never writes through it.
#[tokio::test]
async fn symlinks_planted_in_staging_are_never_followed() {
    for (n, (planted, path)) in [("evil", "evil"), ("dir", "dir/inner")]
        .into_iter()
        .enumerate()
    {
        let s = setup().await;
        let outside = s.base.join("outside");
        std::fs::create_dir(&outside).unwrap();
        let (conn, mut send, mut recv, _) = connect(&s, PROTOCOL_VERSION).await;
        send.write_all(&open(1, "step", vec![file(path, 10)]).encode())
            .await
            .unwrap();
        assert!(matches!(
            read_frame(&mut recv).await.unwrap(),
            Some(Control::Have { .. })
        ));
        let target = if n == 0 {
            outside.join("evil")
        } else {
            outside.clone()
        };
        std::os::unix::fs::symlink(&target, staging_dir(&s).join(planted)).unwrap();
        send_record(&conn, PROTOCOL_VERSION, 1, 0, 0, 0, b"0123456789").await;
        // The sink cancels the transfer (or closes the connection).
        let reply = tokio::time::timeout(Duration::from_secs(20), read_frame(&mut recv)).await;
        match reply {
            Ok(Ok(Some(Control::Cancel {
                id: TransferId(1),
                reason,
            }))) => {
                assert!(reason.contains("staging"), "{reason}")
            }
            Ok(Err(_)) | Ok(Ok(None)) => {}
            other => panic!("{path}: expected a cancel, got {other:?}"),
        }
        let written: Vec<_> = std::fs::read_dir(&outside).unwrap().flatten().collect();
        assert!(
            written.is_empty(),
            "{path}: written outside the sink root: {written:?}"
        );
        assert!(!target.join("inner").exists() && !outside.join("evil").exists());
    }
}

/// A file table whose chunk total overflows a `u64` (65,536 files of
/// 2^64 - 1 bytes in 64 KiB chunks) is refused like any other too-large
/// table, and the connection keeps working.
#[tokio::test]
async fn a_file_table_overflowing_the_chunk_total_is_refused() {
    let s = setup().await;
    let (conn, mut send, mut recv, _) = connect(&s, PROTOCOL_VERSION).await;
    let files: Vec<FileInfo> = (0..65_536)
        .map(|i| file(&format!("f{i}"), u64::MAX))
        .collect();
    let mut msg = open(1, "step", files);
    if let Control::Open(Open {
        chunk_size,
        bytes_total,
        ..
    }) = &mut msg
    {
        *chunk_size = 64 << 10;
        *bytes_total = u64::MAX;
    }
    send.write_all(&msg.encode()).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(20), read_frame(&mut recv))
        .await
        .unwrap();
    match reply {
        Ok(Some(Control::Refuse {
            id: TransferId(1),
            reason,
        })) => {
            assert!(reason.contains("chunk count"), "{reason}")
        }
        other => panic!(
            "expected a refusal, got {other:?} ({:?})",
            conn.close_reason()
        ),
    }
    // Still serving: a plain open is answered.
    send.write_all(&open(2, "step2", vec![file("a", 10)]).encode())
        .await
        .unwrap();
    assert!(matches!(
        read_frame(&mut recv).await.unwrap(),
        Some(Control::Have {
            id: TransferId(2),
            ..
        })
    ));
    assert!(files_under(&s.sink_root).is_empty());
}

/// A version 10 open of transfer `n` (checkpoint `step_<n>`, one 10-byte
/// file `a`) with [`Open::parts_first`] set.
fn open_first(n: u64) -> Control {
    let mut o = open(n, &format!("step_{n}"), vec![file("a", 10)]);
    if let Control::Open(op) = &mut o {
        op.key.origin = Some(ORIGIN.into());
        op.parts_first = true;
    }
    o
}

/// The registration of part 0 (file `a`'s one chunk) of transfer `n`
/// under `epoch`.
fn part(n: u64, epoch: u64) -> Control {
    Control::Part {
        id: TransferId(n),
        part: 0,
        epoch,
        first_key: 0,
        end_key: 1,
    }
}

/// Reads frames up to the registration's answer (batch confirmations may
/// come first): the epoch the sink holds.
async fn epoch_answer(recv: &mut quinn::RecvStream) -> u64 {
    loop {
        match tokio::time::timeout(Duration::from_secs(20), read_frame(recv))
            .await
            .expect("no answer within 20 s")
            .unwrap()
        {
            Some(Control::PartEpoch { epoch, .. }) => return epoch,
            Some(Control::BatchDone { .. }) => {}
            other => panic!("expected a part's epoch, got {other:?}"),
        }
    }
}

/// Reads frames up to the sink's `Have` for transfer `n`.
async fn have_of(recv: &mut quinn::RecvStream, n: u64) {
    loop {
        match tokio::time::timeout(Duration::from_secs(20), read_frame(recv))
            .await
            .expect("no answer within 20 s")
            .unwrap()
        {
            Some(Control::Have { id, .. }) if id == TransferId(n) => return,
            Some(_) => {}
            None => panic!("the control stream ended"),
        }
    }
}

/// A version 10 open with `parts_first`: a chunk that overtakes its
/// part's registration is held until the registration is recorded, then
/// fenced like any other. Registered under an older epoch than another
/// sink agent recorded (written to the shared catalog here), it is
/// refused and the commit asks for it again; registered under the
/// current epoch, it is kept and the transfer publishes.
#[tokio::test]
async fn a_chunk_ahead_of_its_part_s_registration_waits_for_it_and_is_fenced() {
    let s = setup().await;
    let (conn, mut send, mut recv, _) = connect(&s, PROTOCOL_VERSION).await;
    let payload = b"abcdefghij";
    let commit = |n: u64| commit_of(n, payload, 1);

    // Transfer 1: another sink agent of the site recorded epoch 2 of part
    // 0; this source's chunk, sent ahead of its epoch 1 registration, is
    // refused once that registration arrives.
    send.write_all(&open_first(1).encode()).await.unwrap();
    assert!(matches!(
        read_frame(&mut recv).await.unwrap(),
        Some(Control::Have { .. })
    ));
    let cat = s._sink.catalog();
    let row = cat
        .replicas_for_source("/ckpt/job/step_1")
        .await
        .unwrap()
        .into_iter()
        .next()
        .expect("the open's replica row");
    let range = ferry_catalog::PartRange {
        part: 0,
        first_key: 0,
        end_key: 1,
        bytes: 0,
    };
    assert_eq!(
        cat.register_part_epoch(row.id, range, 2, "another-source")
            .await
            .unwrap(),
        2
    );
    let c2 = conn.clone();
    let ahead =
        tokio::spawn(async move { send_record(&c2, PROTOCOL_VERSION, 1, 0, 0, 0, payload).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    send.write_all(&part(1, 1).encode()).await.unwrap();
    assert_eq!(epoch_answer(&mut recv).await, 2);
    ahead.await.unwrap();
    send.write_all(&commit(1).encode()).await.unwrap();
    let (reply, _) = answer_after_confirmations(&mut recv).await;
    match reply {
        Some(Control::Need { chunks, .. }) => assert_eq!(chunks, [0]),
        other => panic!("expected the refused chunk asked for again, got {other:?}"),
    }

    // Transfer 2: the chunk overtakes its registration under the current
    // epoch: held, then kept; the transfer publishes.
    send.write_all(&open_first(2).encode()).await.unwrap();
    have_of(&mut recv, 2).await;
    let c2 = conn.clone();
    let ahead =
        tokio::spawn(async move { send_record(&c2, PROTOCOL_VERSION, 2, 0, 0, 0, payload).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    send.write_all(&part(2, 1).encode()).await.unwrap();
    assert_eq!(epoch_answer(&mut recv).await, 1);
    ahead.await.unwrap();
    send.write_all(&commit(2).encode()).await.unwrap();
    let (reply, done) = answer_after_confirmations(&mut recv).await;
    let Some(Control::Published { local_path, .. }) = reply else {
        panic!("expected published, got {reply:?}");
    };
    assert_eq!(done, [0]);
    assert_eq!(
        std::fs::read(Path::new(&local_path).join("a")).unwrap(),
        payload
    );
    assert!(conn.close_reason().is_none(), "{:?}", conn.close_reason());
}

/// Registers part 0 of transfer `n` under epoch 1, waits for the `held`
/// sends of its one chunk (`payload`) to end, commits it, and checks that
/// it is published with that chunk confirmed in batch 0.
async fn register_and_publish<const N: usize>(
    send: &mut quinn::SendStream,
    recv: &mut quinn::RecvStream,
    n: u64,
    payload: &[u8],
    held: [tokio::task::JoinHandle<()>; N],
) {
    send.write_all(&part(n, 1).encode()).await.unwrap();
    assert_eq!(epoch_answer(recv).await, 1);
    for h in held {
        h.await.unwrap();
    }
    send.write_all(&commit_of(n, payload, 1).encode())
        .await
        .unwrap();
    let (reply, done) = answer_after_confirmations(recv).await;
    assert!(
        matches!(reply, Some(Control::Published { id, .. }) if id == TransferId(n)),
        "expected transfer {n} published with its held chunk, got {reply:?}"
    );
    assert_eq!(done, [0]);
}

/// A chunk held for its part's registration holds no lock while it
/// waits: a commit that fails its transfer (the manifest disagrees with
/// the file table) is answered at once, so the control stream goes on
/// while another transfer's chunk is still within its 10 s wait, and
/// that chunk is kept once its registration comes. A chunk whose part is
/// never registered is dropped when the wait ends, and the commit asks
/// for it again.
#[tokio::test]
async fn a_held_chunk_stalls_no_cancel_and_an_unregistered_one_is_dropped() {
    let s = setup().await;
    let (conn, mut send, mut recv, _) = connect(&s, PROTOCOL_VERSION).await;
    let payload = b"klmnopqrst";
    let ahead = |n: u64| {
        let c = conn.clone();
        tokio::spawn(async move { send_record(&c, PROTOCOL_VERSION, n, 0, 0, 0, payload).await })
    };
    // Transfer 4's chunk starts its wait: this test's clock.
    send.write_all(&open_first(4).encode()).await.unwrap();
    have_of(&mut recv, 4).await;
    let clock = ahead(4);
    // Transfer 3's chunk waits too; its commit (no batch to wait for, a
    // file never announced) fails the transfer.
    send.write_all(&open_first(3).encode()).await.unwrap();
    have_of(&mut recv, 3).await;
    let held = ahead(3);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut wrong = commit_of(3, payload, 0);
    if let Control::Commit(c) = &mut wrong {
        c.manifest.files[0].path = "b".into();
    }
    send.write_all(&wrong.encode()).await.unwrap();
    let (reply, _) = answer_after_confirmations(&mut recv).await;
    assert!(
        matches!(
            reply,
            Some(Control::Cancel {
                id: TransferId(3),
                ..
            })
        ),
        "expected transfer 3 cancelled, got {reply:?}"
    );
    // Transfer 4's chunk is still waiting: the cancel did not sit out
    // transfer 3's 10 s. Registered now, it is kept.
    register_and_publish(&mut send, &mut recv, 4, payload, [clock, held]).await;

    // Transfer 6's part is never registered: its chunk is dropped when
    // the wait ends, and the commit asks for it. (New bytes: a chunk the
    // sink already holds in a published replica is not asked for.)
    let fresh = b"uvwxyz0123";
    send.write_all(&open_first(6).encode()).await.unwrap();
    have_of(&mut recv, 6).await;
    send_record(&conn, PROTOCOL_VERSION, 6, 0, 0, 0, fresh).await;
    // Committed only after the drop: a chunk that ends its wait after the
    // commit is judged against the sealed manifest instead.
    let refused = async {
        loop {
            let m = s._sink.render_metrics().await.unwrap();
            if m.lines().any(|l| l == "ferry_part_chunks_refused_total 1") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(30), refused)
        .await
        .expect("the unregistered chunk was not dropped within 30 s");
    send.write_all(&commit_of(6, fresh, 1).encode())
        .await
        .unwrap();
    let (reply, _) = answer_after_confirmations(&mut recv).await;
    match reply {
        Some(Control::Need { id, chunks }) => {
            assert_eq!(id, TransferId(6));
            assert_eq!(chunks, [0]);
        }
        other => panic!("expected the dropped chunk asked for again, got {other:?}"),
    }
    assert!(conn.close_reason().is_none(), "{:?}", conn.close_reason());
}

/// A chunk waiting for its part's registration stops waiting when its
/// transfer's commit arrives (it is then judged against the sealed
/// manifest), not after the wait's 10 s.
#[tokio::test]
async fn a_commit_ends_a_held_chunks_wait() {
    let s = setup().await;
    let (conn, mut send, mut recv, _) = connect(&s, PROTOCOL_VERSION).await;
    let early = b"0123456789";
    let late = b"abcdefghij";
    // Transfer 8's chunk starts its wait first: this test's clock.
    send.write_all(&open_first(8).encode()).await.unwrap();
    have_of(&mut recv, 8).await;
    let c = conn.clone();
    let clock =
        tokio::spawn(async move { send_record(&c, PROTOCOL_VERSION, 8, 0, 0, 0, early).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Transfer 9's chunk is held too, and its commit comes before any
    // registration: published at once with it.
    send.write_all(&open_first(9).encode()).await.unwrap();
    have_of(&mut recv, 9).await;
    send_record(&conn, PROTOCOL_VERSION, 9, 0, 0, 0, late).await;
    send.write_all(&commit_of(9, late, 1).encode())
        .await
        .unwrap();
    loop {
        match tokio::time::timeout(Duration::from_secs(20), read_frame(&mut recv))
            .await
            .expect("no answer from the sink within 20 s")
            .unwrap()
        {
            Some(Control::BatchDone { id, .. }) => assert_eq!(
                id,
                TransferId(9),
                "transfer 8's held batch ended before transfer 9 was published: \
                 9's chunk sat out its wait after the commit"
            ),
            Some(Control::Published {
                id: TransferId(9), ..
            }) => break,
            other => panic!("expected transfer 9 published with its held chunk, got {other:?}"),
        }
    }
    // Transfer 8's chunk, held since before, is still within its wait:
    // transfer 9's did not sit out its 10 s. Registered now, it is kept.
    register_and_publish(&mut send, &mut recv, 8, early, [clock]).await;
    let m = s._sink.render_metrics().await.unwrap();
    assert!(
        !m.lines()
            .any(|l| l.starts_with("ferry_part_chunks_refused_total ") && !l.ends_with(" 0")),
        "a held chunk was refused"
    );
}

/// An open of transfer `n` (checkpoint `step_<n>`) keyed by [`ORIGIN`],
/// with file table `files`, joining (`joins`) or not.
fn open_origin(n: u64, files: Vec<FileInfo>, joins: bool) -> Control {
    let mut o = open(n, &format!("step_{n}"), files);
    if let Control::Open(op) = &mut o {
        op.key.origin = Some(ORIGIN.into());
        op.joins = joins;
    }
    o
}

/// The next control frame, within 20 s.
async fn next_frame(recv: &mut quinn::RecvStream) -> Control {
    tokio::time::timeout(Duration::from_secs(20), read_frame(recv))
        .await
        .expect("no answer from the sink within 20 s")
        .unwrap()
        .expect("the control stream ended")
}

/// Reads frames up to the confirmation of a batch of transfer `n`.
async fn batch_done_of(recv: &mut quinn::RecvStream, n: u64) {
    loop {
        match next_frame(recv).await {
            Control::BatchDone { id, .. } if id == TransferId(n) => return,
            Control::BatchDone { .. } => {}
            other => panic!("expected transfer {n}'s batch confirmed, got {other:?}"),
        }
    }
}

/// A joining open (another agent of the source's pool, version 11)
/// waits for its coordinator's open to make the transfer's row, works
/// with the row's longer table without cutting it to its own, and its
/// chunks count toward the coordinator's commit. One whose table
/// disagrees with the row's, or whose coordinator never opens, is
/// refused after the wait, naming why.
#[tokio::test]
async fn a_joining_open_waits_for_the_row_and_keeps_its_table() {
    let s = setup().await;
    let (c_conn, mut c_send, mut c_recv, _) = connect(&s, PROTOCOL_VERSION).await;
    let (h_conn, mut h_send, mut h_recv, _) = connect_from(&s, &s.helper, PROTOCOL_VERSION).await;
    let (_h2, mut h2_send, mut h2_recv, _) = connect_from(&s, &s.helper, PROTOCOL_VERSION).await;
    let (pa, pb) = (b"0123456789", b"abcdefghij");
    let both = || vec![file("a", 10), file("b", 10)];

    // Refused after the wait, on a connection of their own (alongside the
    // rest): no coordinator for transfer 7; another table for 6.
    h2_send
        .write_all(&open_origin(7, vec![file("a", 10)], true).encode())
        .await
        .unwrap();
    c_send
        .write_all(&open_origin(6, vec![file("a", 10)], false).encode())
        .await
        .unwrap();
    have_of(&mut c_recv, 6).await;
    h2_send
        .write_all(&open_origin(6, vec![file("x", 10)], true).encode())
        .await
        .unwrap();

    // Transfer 5: the join comes first, with the first file only; the
    // coordinator's open, later, makes the row.
    h_send
        .write_all(&open_origin(5, vec![file("a", 10)], true).encode())
        .await
        .unwrap();
    // No answer while there is no row: the join waits.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), read_frame(&mut h_recv))
            .await
            .is_err(),
        "the joining open was answered before its coordinator's open"
    );
    c_send
        .write_all(&open_origin(5, both(), false).encode())
        .await
        .unwrap();
    have_of(&mut c_recv, 5).await;
    have_of(&mut h_recv, 5).await;
    send_record(&h_conn, PROTOCOL_VERSION, 5, 0, 0, 0, pa).await;
    batch_done_of(&mut h_recv, 5).await;
    send_record(&c_conn, PROTOCOL_VERSION, 5, 0, 1, 0, pb).await;
    let manifest = ferry_proto::manifest::Manifest {
        chunk_size: 4 << 20,
        files: [("a", pa), ("b", pb)]
            .iter()
            .map(|(p, b)| ferry_proto::manifest::FileEntry {
                path: (*p).into(),
                size: 10,
                mode: 0o644,
                mtime_ns: 0,
                chunks: vec![*blake3::hash(*b).as_bytes()],
            })
            .collect(),
        markers: vec![],
    };
    c_send
        .write_all(&Control::Commit(commit_with(5, manifest, 1)).encode())
        .await
        .unwrap();
    let (reply, done) = answer_after_confirmations(&mut c_recv).await;
    let Some(Control::Published { local_path, .. }) = reply else {
        panic!("expected transfer 5 published with the joined agent's chunk, got {reply:?}");
    };
    assert_eq!(done, [0]);
    assert_eq!(std::fs::read(Path::new(&local_path).join("a")).unwrap(), pa);
    assert_eq!(std::fs::read(Path::new(&local_path).join("b")).unwrap(), pb);

    // Transfer 8: file b's chunk is verified before the join with file a
    // only, and the join's answer still lists it: the table was not cut.
    let pc = b"9876543210";
    c_send
        .write_all(&open_origin(8, both(), false).encode())
        .await
        .unwrap();
    have_of(&mut c_recv, 8).await;
    send_record(&c_conn, PROTOCOL_VERSION, 8, 0, 1, 0, pc).await;
    batch_done_of(&mut c_recv, 8).await;
    h_send
        .write_all(&open_origin(8, vec![file("a", 10)], true).encode())
        .await
        .unwrap();
    match next_frame(&mut h_recv).await {
        Control::Have { id, chunks } => {
            assert_eq!(id, TransferId(8));
            assert_eq!(chunks, [1 << 32], "file b's verified chunk was forgotten");
        }
        other => panic!("expected transfer 8's have, got {other:?}"),
    }

    // The two refusals, in either order.
    let mut refused = std::collections::BTreeMap::new();
    while refused.len() < 2 {
        match next_frame(&mut h2_recv).await {
            Control::Refuse { id, reason } => {
                refused.insert(id.0, reason);
            }
            other => panic!("expected refusals of transfers 6 and 7, got {other:?}"),
        }
    }
    assert!(
        refused[&6].contains("at file 0: x (10 bytes"),
        "{}",
        refused[&6]
    );
    assert!(
        refused[&7].contains("no transfer 7") && refused[&7].contains("waited 5 s"),
        "{}",
        refused[&7]
    );
    assert!(
        h_conn.close_reason().is_none(),
        "{:?}",
        h_conn.close_reason()
    );
}
