//! Remote sink roots for the end-to-end tests: an S3 prefix on the
//! SeaweedFS server and an HDFS directory on the MiniDFSCluster that
//! `ops/test` starts (their addresses from FERRY_TEST_S3_URL and
//! FERRY_TEST_HDFS_URL).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use ferry_proto::manifest::Manifest;
use replicator::storage::hdfs::Hdfs;
use replicator::storage::s3::{S3Config, S3};
use replicator::storage::SourceStore;

use super::*;

/// A directory or key prefix of this test's own.
pub fn unique(name: &str) -> String {
    unique_in("ferry-e2e", name)
}

/// Each file's path, size and chunk hashes, and the marker indices: what
/// a replica in a remote store keeps of a checkpoint (an object store
/// keeps no modes; HDFS keeps mtimes to the ms).
pub type Content = (Vec<(String, u64, Vec<[u8; 32]>)>, Vec<u32>);

pub fn content(m: &Manifest) -> Content {
    let files = m
        .files
        .iter()
        .map(|f| (f.path.clone(), f.size, f.chunks.clone()))
        .collect();
    (files, m.markers.clone())
}

/// A remote sink under test: its root URL, the `[sink]` lines after
/// `root`, a store to read it with, the root's path in that store,
/// whether a replica at a path is committed for readers (HDFS: its
/// marker is there; S3: its commit object is), a writer that replaces
/// a file in the store (as something other than Ferry would), and where
/// the bytes of a replica's file are (S3: its version's object).
pub struct RemoteSink {
    pub url: String,
    pub lines: String,
    pub store: Box<dyn SourceStore>,
    pub root: String,
    pub committed: Box<dyn Fn(&Path) -> bool>,
    pub put: Put,
    pub object_of: Box<dyn Fn(&Path) -> PathBuf>,
}

/// Writes one whole file of a store (replacing any there).
pub type Put = Box<dyn Fn(&Path, &[u8]) -> std::io::Result<()>>;

pub fn s3_sink(w: &World, name: &str) -> RemoteSink {
    let s3_url = server_env("FERRY_TEST_S3_URL");
    let (endpoint, bucket) = s3_url.rsplit_once('/').unwrap();
    let key_id = server_env("FERRY_TEST_S3_ACCESS_KEY_ID");
    let secret = server_env("FERRY_TEST_S3_SECRET_ACCESS_KEY");
    let secret_file = w.root.join("s3.secret");
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
    let root = unique(name);
    let url = format!("s3://{bucket}{root}");
    let lines = format!(
        "capacity = \"1TiB\"\n[sink.s3]\nendpoint = {}\naccess_key_id = {}\n\
         secret_access_key_file = {}\n",
        toml_str(endpoint),
        toml_str(&key_id),
        toml_str(secret_file.to_str().unwrap()),
    );
    let store = S3::connect(
        &url,
        &S3Config {
            endpoint: Some(endpoint.to_string()),
            region: None,
            access_key_id: Some(key_id),
            secret_access_key: Some(secret),
            capacity: None,
        },
    )
    .unwrap();
    let reader = store.clone();
    let writer = store.clone();
    let locator = store.clone();
    RemoteSink {
        url,
        lines,
        store: Box::new(store),
        root,
        committed: Box::new(move |p| reader.committed(p).unwrap().is_some()),
        put: Box::new(move |p, data| writer.put_file(p, data)),
        object_of: Box::new(move |p| {
            let u = replicator::storage::SinkStore::located_url(&locator, p)
                .unwrap()
                .unwrap();
            PathBuf::from(format!("/{}", u.splitn(4, '/').nth(3).unwrap()))
        }),
    }
}

pub fn hdfs_sink(name: &str) -> RemoteSink {
    hdfs_sink_with(name, false)
}

/// An HDFS sink; with `versions`, each version in its own directory
/// (`[sink.hdfs] versions = true`), read through the pointer files.
pub fn hdfs_sink_with(name: &str, versions: bool) -> RemoteSink {
    let base = server_env("FERRY_TEST_HDFS_URL");
    let root = unique(name);
    // The sink root must exist.
    Hdfs::connect(&base, None)
        .unwrap()
        .put_file(Path::new(&format!("{root}/README")), b"sink root")
        .unwrap();
    let url = format!("{base}{root}");
    let store = Hdfs::connect(&url, None).unwrap().with_versions(versions);
    let reader = store.clone();
    let writer = store.clone();
    let locator = store.clone();
    RemoteSink {
        url,
        lines: if versions {
            "[sink.hdfs]\nversions = true\n".to_string()
        } else {
            String::new()
        },
        store: Box::new(store),
        root,
        committed: Box::new(move |p| {
            replicator::storage::SinkStore::exists(&reader, &p.join("COMMITTED")).unwrap()
        }),
        put: Box::new(move |p, data| writer.put_file(p, data)),
        object_of: Box::new(move |p| {
            let u = replicator::storage::SinkStore::located_url(&locator, p)
                .unwrap()
                .unwrap();
            PathBuf::from(format!("/{}", u.splitn(4, '/').nth(3).unwrap()))
        }),
    }
}
