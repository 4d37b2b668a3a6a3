//! Shared set-up of the in-process agent tests: a source and a sink joined
//! by the in-memory emulated link.
#![allow(clippy::unwrap_used, missing_docs, dead_code)]

pub mod replay;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use replicator::catalog::Catalog;
use replicator::linkemu::{memory_pair, LinkParams};
use replicator::manifest::MIN_CHUNK_SIZE;
use replicator::sink::{Sink, SinkConfig};
use replicator::source::{LinkConfig, RootConfig, Source, SourceConfig};
use replicator::tls::{self, AgentIdentity};
use replicator::transport::{self, SocketKind};

pub struct Pair {
    pub dir: tempfile::TempDir,
    pub source: Source,
    pub sink: Sink,
    pub root: PathBuf,
}

pub async fn pair(reserve_bytes: u64) -> Pair {
    pair_with(reserve_bytes, |_| {}).await
}

/// A pair whose source settings `adjust` may change (watcher on, root
/// format ...) before the source starts.
pub async fn pair_with(reserve_bytes: u64, adjust: impl FnOnce(&mut SourceConfig)) -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    let certs = base.join("certs");
    tls::init_dev_pki(&certs, &["src".into(), "dst".into()], 2).unwrap();
    let id = |n: &str| {
        AgentIdentity::load(
            &certs.join("ca.pem"),
            &certs.join(format!("{n}.pem")),
            &certs.join(format!("{n}.key")),
        )
        .unwrap()
    };
    let (a, b): (SocketAddr, SocketAddr) =
        ("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
    let params = LinkParams::new(1_000_000_000, Duration::from_millis(10));
    let (sa, sb) = memory_pair(a, b, params.clone(), params);
    let server = quinn::ServerConfig::with_crypto(tls::server_crypto(&id("dst")).unwrap());
    let sink_ep = transport::endpoint(SocketKind::Memory(sb), Some(server)).unwrap();
    let sink = Sink::start(
        SinkConfig {
            agent: "dst".into(),
            site: "train-a".into(),
            root: base.join("eval"),
            accept_peers: vec!["src".into()],
            reserve_bytes,
        },
        Catalog::open(&base.join("dst-data")).await.unwrap(),
        sink_ep,
    )
    .unwrap();
    let root = base.join("ckpt").join("job");
    std::fs::create_dir_all(&root).unwrap();
    let root = std::fs::canonicalize(root).unwrap();
    let src_ep = transport::endpoint(SocketKind::Memory(sa), None).unwrap();
    let mut cfg = SourceConfig {
        agent: "src".into(),
        site: "train-a".into(),
        chunk_size: MIN_CHUNK_SIZE,
        markers: vec![".metadata".into()],
        roots: vec![RootConfig {
            path: root.clone(),
            job: "job".into(),
            link: "l".into(),
            watch: Default::default(),
        }],
        links: vec![LinkConfig {
            name: "l".into(),
            peer: b.to_string(),
            peer_name: "dst".into(),
            rate_bps: 1_000_000_000,
            rtt: Duration::from_millis(10),
        }],
        streams: 3,
        batch_bytes: 256 << 10,
        scan_interval: None,
        quiet_period: Duration::from_millis(300),
        checkpoint_idle_timeout: Duration::from_secs(600),
        policy: Default::default(),
    };
    adjust(&mut cfg);
    let source = Source::start(
        cfg,
        Catalog::open(&base.join("src-data")).await.unwrap(),
        src_ep,
        &id("src"),
    )
    .unwrap();
    Pair {
        dir,
        source,
        sink,
        root,
    }
}

pub async fn wait_published(p: &Pair, id: i64) -> replicator::catalog::Transfer {
    for _ in 0..600 {
        let t = p.source.catalog().transfer(id).await.unwrap().unwrap();
        match t.state.as_str() {
            "published" => return t,
            "failed" | "cancelled" => panic!("transfer {}: {:?}", t.state, t.error),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    panic!("transfer {id} not published within 30 s");
}

pub async fn wait_final(p: &Pair, id: i64) -> replicator::catalog::Transfer {
    for _ in 0..600 {
        let t = p.source.catalog().transfer(id).await.unwrap().unwrap();
        if replicator::catalog::state::is_final(&t.state) {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("transfer {id} did not finish within 30 s");
}

pub fn same_tree(a: &Path, b: &Path) {
    let opts = replicator::manifest::ScanOptions::default();
    let sa = replicator::manifest::scan(a, &opts).unwrap();
    let sb = replicator::manifest::scan(b, &opts).unwrap();
    assert_eq!(
        sa.files, sb.files,
        "file lists (paths, sizes, modes, mtimes) differ"
    );
    for f in &sa.files {
        assert_eq!(
            std::fs::read(a.join(&f.path)).unwrap(),
            std::fs::read(b.join(&f.path)).unwrap(),
            "{}",
            f.path
        );
    }
}
