//! Shared set-up of the in-process agent tests: a source and a sink joined
//! by the in-memory emulated link.
#![allow(clippy::unwrap_used, missing_docs, dead_code)]

pub mod replay;

use ferry_proto::state::TransferId;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_catalog::Catalog;
use ferry_linkemu::{memory_pair, LinkParams};
use ferry_proto::manifest::MIN_CHUNK_SIZE;
use replicator::sink::{Sink, SinkConfig, SinkStorage};
use replicator::source::{LinkConfig, RootConfig, Source, SourceConfig};
use replicator::tls::{self, AgentIdentity};
use replicator::transport::{self, SocketFactory, SocketKind};

pub struct Pair {
    pub dir: tempfile::TempDir,
    pub source: Source,
    pub sink: Sink,
    pub root: PathBuf,
    /// Connections configured for link `l` (what a test that counts the
    /// link's connections expects, rather than assuming one).
    pub connections: u64,
}

pub async fn pair(reserve_bytes: u64) -> Pair {
    pair_with(reserve_bytes, |_| {}).await
}

/// A pair whose source settings `adjust` may change (watcher on, root
/// format ...) before the source starts.
pub async fn pair_with(reserve_bytes: u64, adjust: impl FnOnce(&mut SourceConfig)) -> Pair {
    pair_on(SinkStorage::Local, reserve_bytes, adjust).await
}

/// A pair whose sink keeps its replicas in `storage` (a local directory
/// under the test's own, or an HDFS or S3 root).
pub async fn pair_on(
    storage: SinkStorage,
    reserve_bytes: u64,
    adjust: impl FnOnce(&mut SourceConfig),
) -> Pair {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path();
    let certs = dev_pki(base);
    let (a, b): (SocketAddr, SocketAddr) =
        ("10.0.0.1:1".parse().unwrap(), "10.0.0.2:2".parse().unwrap());
    let params = LinkParams::new(1_000_000_000, Duration::from_millis(10));
    let (sa, sb) = memory_pair(a, b, params.clone(), params);
    let server =
        quinn::ServerConfig::with_crypto(tls::server_crypto(&identity(&certs, "dst")).unwrap());
    let sink_ep = transport::endpoint(SocketKind::Memory(sb), Some(server)).unwrap();
    let sink = start_sink_on(base, reserve_bytes, sink_ep, storage).await;
    let root = job_root(base);
    // A link's further connections: more source-side ends of the same
    // emulated link (one bottleneck), on 10.0.0.1:10, :11, ...
    let (first, next) = (sa.clone(), std::sync::atomic::AtomicU16::new(10));
    let sockets = SocketFactory::Custom(std::sync::Arc::new(move || {
        let port = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let s: std::sync::Arc<dyn quinn::AsyncUdpSocket> =
            first.sibling(SocketAddr::from(([10, 0, 0, 1], port)))?;
        Ok(s)
    }));
    let src_ep = transport::endpoint(SocketKind::Memory(sa), None).unwrap();
    let mut cfg = source_config(&root, b);
    adjust(&mut cfg);
    let connections = cfg.links[0].connections as u64;
    let source = Source::start_with_sockets(
        cfg,
        Catalog::open(&base.join("src-data")).await.unwrap(),
        src_ep,
        Some(sockets),
        &identity(&certs, "src"),
    )
    .unwrap();
    Pair {
        dir,
        source,
        sink,
        root,
        connections,
    }
}

/// A development PKI for agents `src` and `dst` in `base/certs`.
pub fn dev_pki(base: &Path) -> PathBuf {
    let certs = base.join("certs");
    tls::init_dev_pki(&certs, &["src".into(), "dst".into()], 2).unwrap();
    certs
}

pub fn identity(certs: &Path, name: &str) -> AgentIdentity {
    AgentIdentity::load(
        &certs.join("ca.pem"),
        &certs.join(format!("{name}.pem")),
        &certs.join(format!("{name}.key")),
    )
    .unwrap()
}

pub async fn start_sink(base: &Path, reserve_bytes: u64, ep: quinn::Endpoint) -> Sink {
    start_sink_on(base, reserve_bytes, ep, SinkStorage::Local).await
}

/// [`start_sink`] with replicas kept in `storage`.
pub async fn start_sink_on(
    base: &Path,
    reserve_bytes: u64,
    ep: quinn::Endpoint,
    storage: SinkStorage,
) -> Sink {
    Sink::start(
        SinkConfig {
            agent: "dst".into(),
            site: "train-a".into(),
            root: base.join("eval"),
            storage,
            accept_peers: vec!["src".into()],
            reserve_bytes,
            reread_before_publish: true,
            retention: Vec::new(),
            retention_interval: std::time::Duration::from_secs(60),
            pressure: None,
            pool: None,
        },
        Catalog::open(&base.join("dst-data")).await.unwrap(),
        ep,
    )
    .unwrap()
}

/// `base/ckpt/job`, created and canonical.
pub fn job_root(base: &Path) -> PathBuf {
    let root = base.join("ckpt").join("job");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::canonicalize(root).unwrap()
}

/// Source settings of the tests: job `job` at `root`, link `l` to the sink
/// at `peer`, watcher off.
pub fn source_config(root: &Path, peer: SocketAddr) -> SourceConfig {
    SourceConfig {
        agent: "src".into(),
        site: "train-a".into(),
        chunk_size: MIN_CHUNK_SIZE,
        markers: vec![".metadata".into()],
        roots: vec![RootConfig {
            path: root.to_path_buf(),
            job: "job".into(),
            link: "l".into(),
            watch: Default::default(),
        }],
        remotes: Vec::new(),
        links: vec![LinkConfig {
            name: "l".into(),
            peer: peer.to_string(),
            peer_name: "dst".into(),
            more_peers: Vec::new(),
            rate_bps: 1_000_000_000,
            rtt: Duration::from_millis(10),
            connections: 1,
        }],
        streams: 3,
        batch_bytes: 256 << 10,
        scan_interval: None,
        quiet_period: Duration::from_millis(300),
        checkpoint_idle_timeout: Duration::from_secs(600),
        policy: Default::default(),
        pins: Default::default(),
        pool: None,
    }
}

/// A sink on UDP loopback and what it takes to start a source for it, as
/// often as needed, on the same catalog directory (`src-data`): a source
/// agent restarted. (The in-memory link's sockets cannot be taken by a
/// second source endpoint, hence real sockets.)
pub struct Restartable {
    pub dir: tempfile::TempDir,
    pub sink: Sink,
    /// Root of job `job`.
    pub root: PathBuf,
    /// Settings of the first source (link `l` leads to the sink).
    pub cfg: SourceConfig,
    certs: PathBuf,
}

impl Restartable {
    pub async fn new(adjust: impl FnOnce(&mut SourceConfig)) -> Restartable {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path();
        let certs = dev_pki(base);
        let server =
            quinn::ServerConfig::with_crypto(tls::server_crypto(&identity(&certs, "dst")).unwrap());
        let sink_ep = transport::endpoint(
            SocketKind::Udp("127.0.0.1:0".parse().unwrap()),
            Some(server),
        )
        .unwrap();
        let sink_addr = sink_ep.local_addr().unwrap();
        let sink = start_sink(base, 0, sink_ep).await;
        let root = job_root(base);
        let mut cfg = source_config(&root, sink_addr);
        adjust(&mut cfg);
        Restartable {
            dir,
            sink,
            root,
            cfg,
            certs,
        }
    }

    /// Starts a source with `cfg` on the catalog in `src-data` and a new
    /// UDP endpoint. The catalog is opened anew, so a source started
    /// before must have stopped and been dropped (its catalog lock freed).
    pub async fn start_source(&self, cfg: SourceConfig) -> Source {
        let catalog = Catalog::open(&self.dir.path().join("src-data"))
            .await
            .unwrap();
        let ep =
            transport::endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
        let sockets = SocketFactory::Udp("127.0.0.1:0".parse().unwrap());
        Source::start_with_sockets(
            cfg,
            catalog,
            ep,
            Some(sockets),
            &identity(&self.certs, "src"),
        )
        .unwrap()
    }
}

/// Waits (at most 30 s) for `source` to publish transfer `id`.
pub async fn published_by(source: &Source, id: TransferId) -> ferry_catalog::Transfer {
    for _ in 0..600 {
        let t = source.catalog().transfer(id).await.unwrap().unwrap();
        match t.state.as_str() {
            "published" => return t,
            "failed" | "cancelled" => panic!("transfer {}: {:?}", t.state, t.error),
            _ => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
    panic!("transfer {id} not published within 30 s");
}

pub async fn wait_published(p: &Pair, id: TransferId) -> ferry_catalog::Transfer {
    published_by(&p.source, id).await
}

pub async fn wait_final(p: &Pair, id: TransferId) -> ferry_catalog::Transfer {
    for _ in 0..600 {
        let t = p.source.catalog().transfer(id).await.unwrap().unwrap();
        if t.state.is_final() {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("transfer {id} did not finish within 30 s");
}

pub fn same_tree(a: &Path, b: &Path) {
    let opts = replicator::storage::posix::scan::ScanOptions::default();
    let sa = replicator::storage::posix::scan::scan(a, &opts).unwrap();
    let sb = replicator::storage::posix::scan::scan(b, &opts).unwrap();
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

/// Writes `files` files of `size` random bytes (`shard-N.bin`) into `dir`.
pub fn write_dir(dir: &Path, files: usize, size: usize) {
    use rand::RngCore;
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = rand::thread_rng();
    for i in 0..files {
        let mut b = vec![0u8; size];
        rng.fill_bytes(&mut b);
        std::fs::write(dir.join(format!("shard-{i}.bin")), b).unwrap();
    }
}
