//! Roots on HDFS (a MiniDFSCluster) or S3 (SeaweedFS). A sink root there:
//! a checkpoint pushed from a local source root is published there
//! byte-identical, resolves to its URL, and a re-save replaces it. A
//! source root there: a checkpoint written into it is found by the
//! polling watcher (or pushed by its URL) and replicated. The
//! servers are started by `ops/test` (through `ops/with-test-servers`),
//! which passes their addresses in FERRY_TEST_HDFS_URL, FERRY_TEST_S3_URL
//! and the S3 key pair in FERRY_TEST_S3_ACCESS_KEY_ID /
//! FERRY_TEST_S3_SECRET_ACCESS_KEY. Each test works under a directory or
//! key prefix of its own.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::path::{Path, PathBuf};

use common::{pair_on, wait_published};
use ferry_proto::manifest::{Manifest, MIN_CHUNK_SIZE};
use replicator::sink::{Resolution, SinkStorage};
use replicator::storage::hdfs::Hdfs;
use replicator::storage::posix::Posix;
use replicator::storage::s3::{S3Config, S3};
use replicator::storage::{build, SourceStore};

fn server_env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!(
            "{var} is not set: these tests need the storage servers that ops/test starts \
             (run ops/test, or ops/with-test-servers cargo test -p replicator --test remote_roots)"
        )
    })
}

/// A directory or key prefix of this test's own.
fn unique(name: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("/ferry-test/{name}-{}-{t}", std::process::id())
}

/// The S3 test server's endpoint, bucket and key pair.
fn s3_config() -> (String, S3Config) {
    let url = server_env("FERRY_TEST_S3_URL");
    let (endpoint, bucket) = url.rsplit_once('/').unwrap();
    let cfg = S3Config {
        endpoint: Some(endpoint.to_string()),
        region: None,
        access_key_id: Some(server_env("FERRY_TEST_S3_ACCESS_KEY_ID")),
        secret_access_key: Some(server_env("FERRY_TEST_S3_SECRET_ACCESS_KEY")),
        capacity: Some(1 << 40),
    };
    (bucket.to_string(), cfg)
}

/// Writes a checkpoint: a multi-chunk shard, small and empty ones in
/// sub-directories, a temporary (never replicated) and the DCP marker.
fn write_checkpoint(dir: &Path, seed: u8) {
    std::fs::create_dir_all(dir.join("sub/deeper")).unwrap();
    let data = |n: usize| {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<_>>()
    };
    std::fs::write(
        dir.join("__0_0.distcp"),
        data(3 * MIN_CHUNK_SIZE as usize + 123),
    )
    .unwrap();
    std::fs::write(dir.join("__1_0.distcp"), data(5000)).unwrap();
    std::fs::write(dir.join("sub/bias.bin"), data(700)).unwrap();
    std::fs::write(dir.join("sub/deeper/empty"), b"").unwrap();
    std::fs::write(dir.join(".metadata.tmp"), b"temporary: never replicated").unwrap();
    std::fs::write(dir.join(".metadata"), data(99)).unwrap();
}

/// What must match between a checkpoint and its replica in a remote
/// store: every file's path, size and chunk hashes, and the markers
/// (an object store keeps no modes, HDFS keeps mtimes to the ms).
/// Each file's path, size and chunk hashes, and the marker indices.
type Content = (Vec<(String, u64, Vec<[u8; 32]>)>, Vec<u32>);

fn content(m: &Manifest) -> Content {
    let files = m
        .files
        .iter()
        .map(|f| (f.path.clone(), f.size, f.chunks.clone()))
        .collect();
    (files, m.markers.clone())
}

/// Reads the replica at a path as a reader of the store would, `None`
/// when no replica is committed there or the read overlapped a change
/// the store lets a reader detect (HDFS: the listing lacks the marker, or
/// a file changed while read; S3: the commit object changed meanwhile).
type Reader = Box<dyn Fn(&Path) -> Option<Content> + Send + Sync>;

fn hdfs_reader(store: Hdfs) -> Reader {
    Box::new(move |p| {
        let m = build(&store, p, &[".metadata".to_string()], MIN_CHUNK_SIZE).ok()?;
        (!m.markers.is_empty()).then(|| content(&m))
    })
}

fn s3_reader(store: S3) -> Reader {
    Box::new(move |p| {
        let before = store.committed(p).ok()??;
        let m = build(&store, p, &[".metadata".to_string()], MIN_CHUNK_SIZE).ok()?;
        let after = store.committed(p).ok()??;
        (before == after).then(|| content(&m))
    })
}

/// Pushes a checkpoint to a sink on `storage` (whose store, for reading
/// the replica back, is `store`, rooted at `root`), checks the replica and
/// what resolve answers, then re-saves it with one shard changed. A reader
/// polls the replica's path all along: whatever it sees committed is one
/// whole version.
async fn replicates_to(
    storage: SinkStorage,
    store: &dyn SourceStore,
    root: &str,
    url: &str,
    reader: Reader,
) {
    let p = pair_on(storage, 0, |_| {}).await;
    let ckpt = p.root.join("step_2");
    write_checkpoint(&ckpt, 1);
    let markers = [".metadata".to_string()];
    let first = build(&Posix, &ckpt, &markers, MIN_CHUNK_SIZE).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watching = {
        let (stop, replica) = (
            stop.clone(),
            PathBuf::from(format!("{root}/train-a/job/step_2")),
        );
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(c) = reader(&replica) {
                    if seen.last() != Some(&c) {
                        seen.push(c);
                    }
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            seen
        })
    };
    let t = p.source.submit(&ckpt, None).await.unwrap();
    let done = wait_published(&p, t.id).await;
    let want_url = format!("{url}/train-a/job/step_2");
    assert_eq!(
        done.local_path.as_deref(),
        Some(want_url.as_str()),
        "the source records the replica's URL"
    );
    let replica = PathBuf::from(format!("{root}/train-a/job/step_2"));
    let original = build(&Posix, &ckpt, &markers, MIN_CHUNK_SIZE).unwrap();
    let copy = build(store, &replica, &markers, MIN_CHUNK_SIZE).unwrap();
    assert_eq!(
        content(&copy),
        content(&original),
        "the replica is byte-identical"
    );
    assert!(
        copy.files.iter().all(|f| f.path != ".metadata.tmp"),
        "temporaries are not replicated"
    );

    // Resolve answers the URL, for the checkpoint and for a file of it.
    match p.sink.resolve(&ckpt.to_string_lossy()).await.unwrap() {
        Resolution::Local {
            local_path, url, ..
        } => {
            assert_eq!(local_path, None, "no local path on a remote sink");
            assert_eq!(url.as_deref(), Some(want_url.as_str()));
        }
        other => panic!("expected a replica, got {other:?}"),
    }
    // (On S3 a file's URL is its object's, under the version's own
    // prefix: the published path holds only the commit object.)
    let under = format!("{}/sub/bias.bin", ckpt.display());
    match p.sink.resolve(&under).await.unwrap() {
        Resolution::Local { url: Some(u), .. } => {
            if url.starts_with("s3://") {
                assert!(
                    u.starts_with(&format!("{url}/.ferry/versions/"))
                        && u.ends_with("/sub/bias.bin"),
                    "{u}"
                );
            } else {
                assert_eq!(u, format!("{want_url}/sub/bias.bin"));
            }
            let at = format!("/{}", u.splitn(4, '/').nth(3).unwrap());
            let f = store.open(Path::new(&at)).unwrap();
            let want = std::fs::read(ckpt.join("sub/bias.bin")).unwrap();
            assert_eq!(f.read_range(0, want.len() as u64).unwrap(), want, "{u}");
        }
        other => panic!("expected a replica's URL, got {other:?}"),
    }
    let missing = format!("{}/sub/nothing.bin", ckpt.display());
    assert_eq!(
        p.sink.resolve(&missing).await.unwrap(),
        Resolution::Unknown,
        "a file the checkpoint does not hold has no twin"
    );

    // A re-save: one shard changes, one is added; the new version
    // replaces the old one whole.
    write_checkpoint(&ckpt, 2);
    std::fs::write(ckpt.join("__2_0.distcp"), vec![7u8; 3000]).unwrap();
    let t2 = p.source.submit(&ckpt, None).await.unwrap();
    assert_ne!(t2.id, t.id);
    wait_published(&p, t2.id).await;
    let original = build(&Posix, &ckpt, &markers, MIN_CHUNK_SIZE).unwrap();
    let copy = build(store, &replica, &markers, MIN_CHUNK_SIZE).unwrap();
    assert_eq!(
        content(&copy),
        content(&original),
        "the re-saved replica is byte-identical to the new checkpoint"
    );
    let rows = p
        .sink
        .catalog()
        .replicas_for_source(&ckpt.to_string_lossy())
        .await
        .unwrap();
    assert_eq!(rows.len(), 2, "{rows:?}");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let seen = watching.join().unwrap();
    let versions = [content(&first), content(&original)];
    assert!(!seen.is_empty(), "the reader never saw a committed replica");
    println!(
        "{url}: the reader saw {} committed version(s) in turn",
        seen.len()
    );
    for (i, c) in seen.iter().enumerate() {
        assert!(
            versions.contains(c),
            "reading {i} of {} saw a committed replica that is neither version whole",
            seen.len()
        );
    }

    // Removing the newest replica by hand: HDFS takes it out of the
    // namespace in one rename and deletes it; S3 deletes its commit
    // object, then its objects.
    let newest = rows.iter().map(|r| r.id).max().unwrap();
    p.sink.remove(newest, false, "test").await.unwrap();
    let after = p.sink.resolve(&ckpt.to_string_lossy()).await.unwrap();
    assert!(matches!(after, Resolution::Remote { .. }), "{after:?}");
    let mut gone = false;
    for _ in 0..100 {
        if store
            .list(&replica, &[])
            .map_or(true, |l| l.files.is_empty())
        {
            gone = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(gone, "the removed replica's files are still listed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_replicates_to_an_hdfs_sink() {
    let base = server_env("FERRY_TEST_HDFS_URL");
    let root = unique("hdfs-sink");
    // The sink root must exist: make it with a file in it.
    let h = Hdfs::connect(&base, None).unwrap();
    h.put_file(
        Path::new(&format!("{root}/README")),
        b"ferry test sink root",
    )
    .unwrap();
    let url = format!("{base}{root}");
    let storage = SinkStorage::Hdfs {
        url: url.clone(),
        capacity: None,
        hot: None,
        versions: false,
    };
    let store = Hdfs::connect(&url, None).unwrap();
    let reader = hdfs_reader(store.clone());
    replicates_to(storage, &store, &root, &url, reader).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_replicates_to_an_s3_sink() {
    let (bucket, cfg) = s3_config();
    let root = unique("s3-sink");
    let url = format!("s3://{bucket}{root}");
    let store = S3::connect(&url, &cfg).unwrap();
    let reader = s3_reader(store.clone());
    let storage = SinkStorage::S3 {
        url: url.clone(),
        config: cfg,
    };
    replicates_to(storage, &store, &root, &url, reader).await;
}

#[tokio::test]
async fn a_sink_on_a_store_it_cannot_use_does_not_start() {
    let (bucket, mut cfg) = s3_config();
    cfg.secret_access_key = Some("not-the-secret".into());
    let url = format!("s3://{bucket}{}", unique("bad-secret"));
    let dir = tempfile::tempdir().unwrap();
    let ep = replicator::transport::endpoint(
        replicator::transport::SocketKind::Udp("127.0.0.1:0".parse().unwrap()),
        None,
    )
    .unwrap();
    let storage = SinkStorage::S3 {
        url: url.clone(),
        config: cfg,
    };
    let e = replicator::sink::Sink::start(
        replicator::sink::SinkConfig {
            agent: "dst".into(),
            site: "train-a".into(),
            root: PathBuf::new(),
            storage,
            accept_peers: Vec::new(),
            reserve_bytes: 0,
            reread_before_publish: true,
            retention: Vec::new(),
            retention_interval: std::time::Duration::from_secs(60),
            pressure: None,
            pool: None,
        },
        ferry_catalog::Catalog::open(&dir.path().join("data"))
            .await
            .unwrap(),
        ep,
    )
    .expect_err("a sink with a wrong secret must not start");
    let msg = e.to_string();
    assert!(msg.contains(&url), "the error names the root: {msg}");
    assert!(
        !msg.contains("not-the-secret"),
        "no secret in errors: {msg}"
    );
}

#[test]
fn an_hdfs_sink_root_that_does_not_exist_says_how_to_create_it() {
    let url = format!(
        "{}{}",
        server_env("FERRY_TEST_HDFS_URL"),
        unique("missing-root")
    );
    let e = SinkStorage::Hdfs {
        url: url.clone(),
        capacity: None,
        hot: None,
        versions: false,
    }
    .open(Path::new(""))
    .expect_err("a missing HDFS root must be refused");
    let msg = e.to_string();
    assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{msg}");
    assert!(
        msg.contains(&url) && msg.contains("does not exist") && msg.contains("hdfs dfs -mkdir -p"),
        "the error names the root and the next step: {msg}"
    );
}

/// Writes a checkpoint of the generic format into `dir` of a remote store
/// with `put`, file by file, the `COMMITTED` marker last (as a writer
/// would); returns the files, path and bytes.
fn put_checkpoint(
    put: &dyn Fn(&Path, &[u8]) -> std::io::Result<()>,
    dir: &str,
    seed: u8,
) -> Vec<(String, Vec<u8>)> {
    let data = |n: usize| {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed))
            .collect::<Vec<_>>()
    };
    let files = vec![
        (
            "shard-0.bin".to_string(),
            data(2 * MIN_CHUNK_SIZE as usize + 77),
        ),
        ("shard-1.bin".to_string(), data(3000)),
        ("extra/state.bin".to_string(), data(500)),
        ("COMMITTED".to_string(), b"done".to_vec()),
    ];
    for (rel, bytes) in &files {
        put(Path::new(&format!("{dir}/{rel}")), bytes).unwrap();
    }
    files
}

/// A source whose root is `url` (opened as `store`) replicates to a local
/// sink: with the watcher polling, a checkpoint written into the root is
/// published; a second one is pushed by its URL. Both replicas are
/// byte-identical and resolve from their source URLs.
async fn replicates_from(url: &str, put: &dyn Fn(&Path, &[u8]) -> std::io::Result<()>, root: &str) {
    let opened = replicator::storage::router::open_remote(url, &s3_config().1).unwrap();
    let url_s = url.to_string();
    let p = pair_on(SinkStorage::Local, 0, move |cfg| {
        cfg.scan_interval = Some(std::time::Duration::from_millis(300));
        cfg.quiet_period = std::time::Duration::from_millis(300);
        cfg.roots[0].path = PathBuf::from(&url_s);
        cfg.roots[0].watch.mode = replicator::source::watcher::Mode::Poll;
        cfg.roots[0].watch.format = Some(replicator::formats::Format::Generic);
        cfg.markers = vec!["COMMITTED".into()];
        cfg.remotes = vec![opened];
    })
    .await;
    // Watched: written into the root, found by the polling watcher.
    let files = put_checkpoint(put, &format!("{root}/step_5"), 1);
    let src = format!("{url}/step_5");
    let local = wait_local(&p, &src).await;
    for (rel, bytes) in &files {
        assert_eq!(
            &std::fs::read(local.join(rel)).unwrap(),
            bytes,
            "{rel} of the watched checkpoint"
        );
    }
    // Pushed by its URL (the watcher would find it too; the push is
    // answered by the same transfer or a new one, never a failure).
    let files = put_checkpoint(put, &format!("{root}/step_6"), 2);
    let src6 = format!("{url}/step_6");
    p.source.submit(Path::new(&src6), None).await.unwrap();
    let local = wait_local(&p, &src6).await;
    for (rel, bytes) in &files {
        assert_eq!(&std::fs::read(local.join(rel)).unwrap(), bytes, "{rel}");
    }
    // A file of it resolves from its URL too.
    match p
        .sink
        .resolve(&format!("{src6}/extra/state.bin"))
        .await
        .unwrap()
    {
        Resolution::Local { local_path, .. } => {
            assert_eq!(
                local_path.map(PathBuf::from),
                Some(local.join("extra/state.bin"))
            )
        }
        other => panic!("expected a replica, got {other:?}"),
    }
    // A URL that is not under the root is refused, naming it.
    let e = p
        .source
        .submit(Path::new(&format!("{url}-other/step_1")), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("not under"), "{e}");
    let e = p
        .source
        .submit(Path::new(&format!("{url}/step_404")), None)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("step_404"), "{e}");
}

/// Waits (at most 60 s) for `src` to resolve to a local replica.
async fn wait_local(p: &common::Pair, src: &str) -> PathBuf {
    for _ in 0..600 {
        if let Resolution::Local {
            local_path: Some(l),
            ..
        } = p.sink.resolve(src).await.unwrap()
        {
            return PathBuf::from(l);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let ts = p.source.catalog().transfers(100, 0).await.unwrap();
    panic!("{src} not replicated within 60 s; the source's transfers: {ts:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_in_an_hdfs_source_root_is_watched_and_replicated() {
    let base = server_env("FERRY_TEST_HDFS_URL");
    let root = unique("hdfs-source");
    let h = Hdfs::connect(&base, None).unwrap();
    h.put_file(Path::new(&format!("{root}/README")), b"source root")
        .unwrap();
    let put = |p: &Path, b: &[u8]| h.put_file(p, b);
    replicates_from(&format!("{base}{root}"), &put, &root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_in_an_s3_source_root_is_watched_and_replicated() {
    let (bucket, cfg) = s3_config();
    let root = unique("s3-source");
    let url = format!("s3://{bucket}{root}");
    let s3 = S3::connect(&format!("s3://{bucket}"), &cfg).unwrap();
    let put = |p: &Path, b: &[u8]| s3.put_file(p, b);
    replicates_from(&url, &put, &root).await;
}

/// A NeMo 2 save in a polled remote root: its `<name>-unfinished` marker
/// has a temporary's name, which listings leave out, yet while it exists
/// the checkpoint stays open though `weights/` looks committed and every
/// file is quiet; once it is removed the checkpoint is replicated whole.
async fn nemo_waits_for_its_unfinished_marker(
    url: &str,
    put: &dyn Fn(&Path, &[u8]) -> std::io::Result<()>,
    remove: &dyn Fn(&Path) -> std::io::Result<()>,
    root: &str,
) {
    let opened = replicator::storage::router::open_remote(url, &s3_config().1).unwrap();
    let url_s = url.to_string();
    let p = pair_on(SinkStorage::Local, 0, move |cfg| {
        cfg.scan_interval = Some(std::time::Duration::from_millis(200));
        cfg.quiet_period = std::time::Duration::from_millis(200);
        cfg.roots[0].path = PathBuf::from(&url_s);
        cfg.roots[0].watch.mode = replicator::source::watcher::Mode::Poll;
        cfg.roots[0].watch.format = Some(replicator::formats::Format::Nemo);
        cfg.remotes = vec![opened];
    })
    .await;
    let name = "gpt--step=99-consumed_samples=792.0";
    let marker = format!("{root}/{name}-unfinished");
    put(Path::new(&marker), b"").unwrap();
    // A shard ends in a zip end record, as torch.save writes it (the
    // poll rule checks it): no entries, its directory at the record.
    let mut shard = vec![7u8; 40_000];
    shard.extend_from_slice(b"PK\x05\x06\0\0\0\0\0\0\0\0\0\0\0\0");
    shard.extend_from_slice(&40_000u32.to_le_bytes());
    shard.extend_from_slice(&[0, 0]);
    let files: Vec<(String, Vec<u8>)> = vec![
        ("weights/__0_0.distcp".into(), shard),
        ("weights/.metadata".into(), vec![1u8; 900]),
        (
            "weights/metadata.json".into(),
            br#"{"sharded_backend": "torch_dist", "sharded_backend_version": 1}"#.to_vec(),
        ),
        ("context/model.yaml".into(), b"hidden_size: 64\n".to_vec()),
    ];
    for (rel, bytes) in &files {
        put(Path::new(&format!("{root}/{name}/{rel}")), bytes).unwrap();
    }
    let src = format!("{url}/{name}");
    // Well past the quiet period, over many polls: still open.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let r = p.sink.resolve(&src).await.unwrap();
    assert!(
        !matches!(r, Resolution::Local { .. }),
        "published while {marker} exists: {r:?}"
    );
    let ts = p.source.catalog().transfers(100, 0).await.unwrap();
    assert!(
        ts.iter().all(|t| t.committed_at.is_none()),
        "committed while {marker} exists: {ts:#?}"
    );
    remove(Path::new(&marker)).unwrap();
    let local = wait_local(&p, &src).await;
    for (rel, bytes) in &files {
        assert_eq!(&std::fs::read(local.join(rel)).unwrap(), bytes, "{rel}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nemo_save_in_hdfs_waits_for_its_unfinished_marker() {
    let base = server_env("FERRY_TEST_HDFS_URL");
    let root = unique("hdfs-nemo");
    let h = Hdfs::connect(&base, None).unwrap();
    h.put_file(Path::new(&format!("{root}/README")), b"source root")
        .unwrap();
    let put = |p: &Path, b: &[u8]| h.put_file(p, b);
    let remove = |p: &Path| h.remove_file(p).map(drop);
    nemo_waits_for_its_unfinished_marker(&format!("{base}{root}"), &put, &remove, &root).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nemo_save_in_s3_waits_for_its_unfinished_marker() {
    let (bucket, cfg) = s3_config();
    let root = unique("s3-nemo");
    let s3 = S3::connect(&format!("s3://{bucket}"), &cfg).unwrap();
    let put = |p: &Path, b: &[u8]| s3.put_file(p, b);
    let remove = |p: &Path| s3.remove_file(p);
    nemo_waits_for_its_unfinished_marker(&format!("s3://{bucket}{root}"), &put, &remove, &root)
        .await;
}

/// Hot-file hints at an HDFS sink: the files every eval rank reads (here
/// DCP's `.metadata`) get the raised replication factor before the
/// publish, resolve shows it, and once the hint's TTL has passed they are
/// back at the factor they were written with, also when the sink agent
/// restarted in between (the hint is in the catalog).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_files_of_an_hdfs_replica_are_raised_then_set_back() {
    use replicator::storage::hdfs::HotFiles;
    let base = server_env("FERRY_TEST_HDFS_URL");
    let root = unique("hdfs-hot");
    let h = Hdfs::connect(&base, None).unwrap();
    h.put_file(Path::new(&format!("{root}/README")), b"sink root")
        .unwrap();
    let url = format!("{base}{root}");
    const FACTOR: u16 = 5;
    let ttl = std::time::Duration::from_secs(4);
    // The publish waits (at most 1 s here) for the raised replicas to be
    // placed; the test cluster's two DataNodes never hold 5, and the
    // publish goes ahead.
    let web = server_env("FERRY_TEST_WEBHDFS_URL");
    let storage = SinkStorage::Hdfs {
        url: url.clone(),
        capacity: None,
        hot: Some(
            HotFiles::new(FACTOR, &["sub/*.bin".to_string()], ttl)
                .unwrap()
                .placed_via(&web, std::time::Duration::from_secs(1)),
        ),
        versions: false,
    };
    let p = pair_on(storage.clone(), 0, |_| {}).await;
    let ckpt = p.root.join("step_7");
    write_checkpoint(&ckpt, 3);
    let t = p.source.submit(&ckpt, None).await.unwrap();
    wait_published(&p, t.id).await;
    let store = Hdfs::connect(&url, None).unwrap();
    let replica = format!("{root}/train-a/job/step_7");
    let factor = |rel: &str| {
        store
            .replication(Path::new(&format!("{replica}/{rel}")))
            .unwrap()
    };
    let written = factor("__0_0.distcp");
    assert!(
        written < FACTOR,
        "files are written with {written} replicas"
    );
    assert_eq!(factor(".metadata"), FACTOR, "a built-in hot name");
    assert_eq!(factor("sub/bias.bin"), FACTOR, "an extra hot glob");
    assert_eq!(
        factor("sub/deeper/empty"),
        written,
        "`*` stays in one directory"
    );
    match p.sink.resolve(&ckpt.to_string_lossy()).await.unwrap() {
        Resolution::Local { hot: Some(h), .. } => {
            assert_eq!(
                (h.factor, h.previous),
                (i64::from(FACTOR), i64::from(written))
            )
        }
        other => panic!("resolve should show the hint: {other:?}"),
    }
    // The sink agent stops before the hint ends; another starts on its
    // catalog and sets the files back.
    let common::Pair {
        dir, source, sink, ..
    } = p;
    sink.shutdown(std::time::Duration::from_secs(5)).await;
    source.shutdown(std::time::Duration::from_secs(5)).await;
    drop((sink, source));
    // The catalog's agent lock goes with the last of the old sink's tasks.
    let mut catalog = None;
    for _ in 0..100 {
        match ferry_catalog::Catalog::open(&dir.path().join("dst-data")).await {
            Ok(c) => {
                catalog = Some(c);
                break;
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    }
    let ep = replicator::transport::endpoint(
        replicator::transport::SocketKind::Udp("127.0.0.1:0".parse().unwrap()),
        None,
    )
    .unwrap();
    let sink = replicator::sink::Sink::start(
        replicator::sink::SinkConfig {
            agent: "dst".into(),
            site: "train-a".into(),
            root: PathBuf::new(),
            storage,
            accept_peers: Vec::new(),
            reserve_bytes: 0,
            reread_before_publish: true,
            retention: Vec::new(),
            retention_interval: std::time::Duration::from_secs(60),
            pressure: None,
            pool: None,
        },
        catalog.expect("the stopped sink's catalog could not be opened again within 10 s"),
        ep,
    )
    .unwrap();
    let mut back = false;
    for _ in 0..300 {
        if factor(".metadata") == written && factor("sub/bias.bin") == written {
            back = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        back,
        "the hot files are not back at {written} replicas after the TTL"
    );
    match sink.resolve(&ckpt.to_string_lossy()).await.unwrap() {
        Resolution::Local { hot: None, .. } => {}
        other => panic!("the hint should be gone: {other:?}"),
    }
}

/// WebHDFS tells how many DataNodes hold a file's blocks (files are
/// written with one replica; the test cluster has two DataNodes): a
/// factor raised to 2 is seen placed, a wait for 3 ends at its bound with
/// what it saw, a file without blocks has nothing to place, and a missing
/// file or a WebHDFS that does not answer is an error naming it.
#[test]
fn webhdfs_shows_where_hdfs_placed_a_files_blocks() {
    let base = server_env("FERRY_TEST_HDFS_URL");
    let web = server_env("FERRY_TEST_WEBHDFS_URL");
    let root = unique("hdfs-placed");
    let h = Hdfs::connect(&base, None).unwrap();
    let file = format!("{root}/a/.metadata");
    let empty = format!("{root}/a/empty");
    h.put_file(Path::new(&file), &vec![7u8; 100_000]).unwrap();
    h.put_file(Path::new(&empty), b"").unwrap();
    assert_eq!(
        h.placed_replicas(&web, std::slice::from_ref(&file))
            .unwrap(),
        Some(1)
    );
    assert_eq!(
        h.placed_replicas(&web, std::slice::from_ref(&empty))
            .unwrap(),
        None
    );
    let both = [file.clone(), empty.clone()];
    // Raised as a publish raises a hot file; HDFS copies the block to the
    // other DataNode in the background.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = hdfs_native::ClientBuilder::new()
            .with_url(&base)
            .build()
            .unwrap();
        assert!(c.set_replication(&file, 2).await.unwrap());
    });
    drop(rt);
    assert_eq!(
        h.wait_placed(&web, &both, 2, std::time::Duration::from_secs(60))
            .unwrap(),
        Some(2),
        "the raised replica placed"
    );
    assert_eq!(
        h.wait_placed(&web, &both, 3, std::time::Duration::from_millis(1200))
            .unwrap(),
        Some(2),
        "two DataNodes cannot hold 3 replicas: the wait ends with what it saw"
    );
    let e = h
        .placed_replicas(&web, &[format!("{root}/a/none")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("/a/none") && e.contains("does not exist"), "{e}");
    let e = h
        .placed_replicas("http://127.0.0.1:1", &[file])
        .unwrap_err()
        .to_string();
    assert!(e.contains("127.0.0.1:1"), "{e}");
}

/// A transfer that says how many readers its replica expects sizes the
/// HDFS sink's hints from it (`ceil(readers / readers_per_replica)`, at
/// most the DataNodes); one that does not gets the configured factor,
/// here none.
#[tokio::test]
async fn readers_said_by_a_transfer_size_the_hdfs_hints() {
    use replicator::hold::HoldPoint;
    use replicator::storage::hdfs::HotFiles;
    let base = server_env("FERRY_TEST_HDFS_URL");
    let root = unique("hdfs-readers");
    let h = Hdfs::connect(&base, None).unwrap();
    h.put_file(Path::new(&format!("{root}/README")), b"sink root")
        .unwrap();
    let url = format!("{base}{root}");
    let ttl = std::time::Duration::from_secs(3600);
    // No configured readers: hints only for transfers that say.
    let hot = HotFiles::new(0, &[], ttl).unwrap().sized(100, 6);
    assert_eq!(hot.factor_for_readers(Some(450)), 5);
    assert_eq!(
        hot.factor_for_readers(Some(100_000)),
        6,
        "at most the DataNodes"
    );
    assert_eq!(hot.factor_for_readers(None), 0);
    let storage = SinkStorage::Hdfs {
        url: url.clone(),
        capacity: None,
        hot: Some(hot),
        versions: false,
    };
    let p = pair_on(storage, 0, |_| {}).await;
    let store = Hdfs::connect(&url, None).unwrap();
    let factor = |step: &str, rel: &str| {
        store
            .replication(Path::new(&format!("{root}/train-a/job/{step}/{rel}")))
            .unwrap()
    };
    for (step, readers) in [("step_8", Some(450)), ("step_9", None)] {
        let ckpt = p.root.join(step);
        write_checkpoint(&ckpt, 2);
        // The readers are said after the run began, before its commit.
        let mut commit = p.source.hold_at(HoldPoint::Commit);
        let t = p.source.submit(&ckpt, None).await.unwrap();
        let held = tokio::time::timeout(std::time::Duration::from_secs(30), commit.reached())
            .await
            .expect("the run reached its commit");
        assert_eq!(held, Some(t.id));
        p.source
            .catalog()
            .set_transfer_readers(t.id, readers)
            .await
            .unwrap();
        commit.release();
        wait_published(&p, t.id).await;
        let written = factor(step, "__0_0.distcp");
        let want = if readers.is_some() { 5 } else { written };
        assert_eq!(
            factor(step, ".metadata"),
            want,
            "{step}, readers {readers:?}"
        );
        assert_eq!(factor(step, "__0_0.distcp"), written, "not a hot file");
    }
}
