//! A hand-driven source that sends what a real one never would: paths that
//! escape the sink root, oversized lengths, a wrong protocol version. The
//! sink must refuse each, close the connection where the protocol is
//! broken, and write nothing outside its root.
#![allow(clippy::unwrap_used, missing_docs)]

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use quinn::{Connection, Endpoint};
use replicator::catalog::Catalog;
use replicator::conn::read_frame;
use replicator::sink::{Sink, SinkConfig};
use replicator::tls::{self, AgentIdentity};
use replicator::transport::{self, SocketKind};
use replicator::wire::{
    BatchHeader, Control, FileInfo, Hello, RecordHeader, TransferKey, MAX_CHUNK, PROTOCOL_VERSION,
};

struct Setup {
    _dir: tempfile::TempDir,
    base: std::path::PathBuf,
    sink_root: std::path::PathBuf,
    sink_addr: SocketAddr,
    client: Endpoint,
    _sink: Sink,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_path_buf();
    let certs = base.join("certs");
    tls::init_dev_pki(&certs, &["evil-src".into(), "sink-1".into()], 2).unwrap();
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
            accept_peers: vec![],
            reserve_bytes: 0,
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
    Setup {
        _dir: dir,
        base,
        sink_root,
        sink_addr,
        client,
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
    let conn = s
        .client
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
    let bytes_total = files.iter().map(|f| f.size).sum();
    Control::Open {
        key: TransferKey {
            id,
            job: "job".into(),
            source_path: format!("/ckpt/job/{rel}"),
            rel: rel.into(),
            profile: String::new(),
        },
        chunk_size: 4 << 20,
        bytes_total,
        files,
    }
}

fn file(path: &str, size: u64) -> FileInfo {
    FileInfo {
        path: path.into(),
        size,
        mode: 0o644,
        mtime_ns: 0,
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
                assert_eq!(id, i as u64 + 1);
                assert!(!reason.is_empty());
            }
            other => panic!("case {i}: expected refuse, got {other:?}"),
        }
    }
    // The job name is also a path component.
    let mut bad_job = open(7, "ok", vec![file("x", 5)]);
    if let Control::Open { key, .. } = &mut bad_job {
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
    data.write_all(&BatchHeader { transfer: 1 }.encode())
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
            id: 1,
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
    data.write_all(&BatchHeader { transfer: 1 }.encode())
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
