//! `ferry gen --out hdfs://...` and `--out s3://...` against the real
//! servers (a MiniDFSCluster and SeaweedFS): DCP, HF and DeepSpeed saves
//! and the per-tensor layout land in the store with the same files, sizes
//! and bytes as the same `ferry gen` into a local directory, as the
//! store's own listing (`SourceStore::list`) and reads show them, with
//! each commit marker written after every other file; unreachable stores,
//! refused credentials and a missing bucket fail naming the URL.
//!
//! The servers are started by `ops/test` (through
//! `ops/with-test-servers`), which passes their addresses in
//! FERRY_TEST_HDFS_URL, FERRY_TEST_S3_URL and the S3 key pair in
//! FERRY_TEST_S3_ACCESS_KEY_ID / FERRY_TEST_S3_SECRET_ACCESS_KEY.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use replicator::storage::hdfs::Hdfs;
use replicator::storage::posix::Posix;
use replicator::storage::s3::{S3Config, S3};
use replicator::storage::{ScanError, SourceStore};

/// Bound for one `ferry gen`.
const GEN: Duration = Duration::from_secs(300);

/// A directory or key prefix of this test's own.
fn unique(name: &str) -> String {
    unique_in("ferry-gen", name)
}

/// One save to compare: `ferry gen` flags (after `--out`) and its commit
/// markers, relative to the root.
struct Case {
    name: &'static str,
    args: &'static [&'static str],
    markers: &'static [&'static str],
}

const CASES: [Case; 4] = [
    Case {
        name: "dcp",
        args: &["--format", "dcp", "--size", "6MB", "--ranks", "3"],
        markers: &["step_00001000/.metadata"],
    },
    Case {
        name: "hf",
        args: &["--format", "hf", "--size", "6MB"],
        markers: &["step-1000/model.safetensors.index.json"],
    },
    Case {
        name: "deepspeed",
        args: &["--format", "deepspeed", "--size", "6MB", "--ranks", "3"],
        markers: &["latest"],
    },
    // Its largest files (about 9.4 MB) go to S3 as multipart uploads.
    Case {
        name: "per-tensor",
        args: &["--size", "30MB"],
        markers: &["COMMITTED"],
    },
];

/// Every file under `dir` of `store`: size, mtime (ns) and bytes, by path
/// relative to `dir`.
fn contents(store: &dyn SourceStore, dir: &Path) -> BTreeMap<String, (u64, i64, Vec<u8>)> {
    let listing = store
        .list(dir, &[])
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()));
    listing
        .files
        .into_iter()
        .map(|f| {
            let path = dir.join(&f.info.path);
            let bytes = store
                .open(&path)
                .and_then(|r| r.read_range(0, f.info.size))
                .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            (f.info.path, (f.info.size, f.info.mtime_ns, bytes))
        })
        .collect()
}

/// Runs every case into `url_of(case)` (a remote root) and into a local
/// directory, and compares what `store` lists under `path_of(case)`.
async fn gen_matches_local(
    w: &World,
    store: &dyn SourceStore,
    base_url: &str,
    base_path: &str,
    extra: &[&str],
    secret: Option<&str>,
) {
    for case in &CASES {
        let url = format!("{base_url}/{}", case.name);
        let local = w.root.join("local").join(case.name);
        let mut args = vec!["gen", "--seed", "7"];
        args.extend_from_slice(case.args);
        let mut local_args = args.clone();
        local_args.extend(["--out", local.to_str().unwrap()]);
        let out = w.ferry(&local_args, &[], GEN).await;
        w.ensure(out.success(), || {
            format!("local ferry gen {}: {out}", case.name)
        });

        args.extend(["--out", &url]);
        args.extend_from_slice(extra);
        let out = w.ferry(&args, &[], GEN).await;
        w.ensure(out.success(), || format!("ferry gen --out {url}: {out}"));
        if let Some(secret) = secret {
            w.ensure(!out.all().contains(secret), || {
                format!("the secret key was printed: {out}")
            });
        }
        let summary = out.stdout.lines().last().unwrap_or_default();
        w.ensure(summary.starts_with(&url), || {
            format!("ferry gen --out {url} should name the URL: {out}")
        });

        let want = contents(&Posix, &local);
        let remote_dir = PathBuf::from(format!("{base_path}/{}", case.name));
        let got = contents(store, &remote_dir);
        let names = |m: &BTreeMap<String, (u64, i64, Vec<u8>)>| {
            m.iter()
                .map(|(p, (size, _, _))| (p.clone(), *size))
                .collect::<Vec<_>>()
        };
        w.ensure(names(&got) == names(&want), || {
            format!(
                "{url}: files and sizes differ from {}:\n{:?}\nvs\n{:?}",
                local.display(),
                names(&got),
                names(&want)
            )
        });
        for (path, (_, _, bytes)) in &want {
            w.ensure(&got[path].2 == bytes, || {
                format!("{url}/{path}: bytes differ from the local file")
            });
        }
        // Markers last: none is older than any other file.
        let newest_other = got
            .iter()
            .filter(|(p, _)| !case.markers.contains(&p.as_str()))
            .map(|(_, (_, mtime, _))| *mtime)
            .max()
            .unwrap();
        for m in case.markers {
            let (_, mtime, _) = got
                .get(*m)
                .unwrap_or_else(|| w.fail(format!("{url}: no marker {m}")));
            w.ensure(*mtime >= newest_other, || {
                format!("{url}: marker {m} (mtime {mtime}) before another file ({newest_other})")
            });
        }
    }
}

#[tokio::test]
async fn gen_into_hdfs_writes_the_local_files_markers_last() {
    let w = World::new("gen-hdfs").await;
    let base = server_env("FERRY_TEST_HDFS_URL");
    let root = unique("hdfs");
    let store = Hdfs::connect(&base, None).unwrap();
    gen_matches_local(&w, &store, &format!("{base}{root}"), &root, &[], None).await;
}

fn s3_config(endpoint: &str, key_id: &str, secret: &str) -> S3Config {
    S3Config {
        endpoint: Some(endpoint.to_string()),
        region: None,
        access_key_id: Some(key_id.to_string()),
        secret_access_key: Some(secret.to_string()),
        capacity: None,
    }
}

#[tokio::test]
async fn gen_into_s3_writes_the_local_files_markers_last() {
    let w = World::new("gen-s3").await;
    let s3_url = server_env("FERRY_TEST_S3_URL");
    let (endpoint, bucket) = s3_url.rsplit_once('/').unwrap();
    let key_id = server_env("FERRY_TEST_S3_ACCESS_KEY_ID");
    let secret = server_env("FERRY_TEST_S3_SECRET_ACCESS_KEY");
    let secret_file = w.root.join("s3.secret");
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
    let root = unique("s3");
    let store = S3::connect(
        &format!("s3://{bucket}"),
        &s3_config(endpoint, &key_id, &secret),
    )
    .unwrap();
    let flags = [
        "--s3-endpoint",
        endpoint,
        "--s3-access-key-id",
        &key_id,
        "--s3-secret-access-key-file",
        secret_file.to_str().unwrap(),
    ];
    gen_matches_local(
        &w,
        &store,
        &format!("s3://{bucket}{root}"),
        &root,
        &flags,
        Some(&secret),
    )
    .await;
}

#[tokio::test]
async fn gen_into_a_store_it_cannot_use_fails_naming_the_url() {
    let w = World::new("gen-bad-store").await;
    let s3_url = server_env("FERRY_TEST_S3_URL");
    let (endpoint, bucket) = s3_url.rsplit_once('/').unwrap();
    let key_id = server_env("FERRY_TEST_S3_ACCESS_KEY_ID");
    let secret = server_env("FERRY_TEST_S3_SECRET_ACCESS_KEY");
    let secret_file = w.root.join("s3.secret");
    std::fs::write(&secret_file, &secret).unwrap();
    let root = unique("bad");
    let store = S3::connect(
        &format!("s3://{bucket}"),
        &s3_config(endpoint, &key_id, &secret),
    )
    .unwrap();
    let secret_path = secret_file.to_str().unwrap();
    let refused_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let unreachable = format!("http://127.0.0.1:{refused_port}");
    let cases: [(String, Vec<&str>, &str); 4] = [
        // An unreachable NameNode.
        (
            format!("hdfs://127.0.0.1:{refused_port}{root}"),
            vec![],
            "refused",
        ),
        // An unreachable endpoint.
        (
            format!("s3://{bucket}{root}/a"),
            vec![
                "--s3-endpoint",
                &unreachable,
                "--s3-access-key-id",
                &key_id,
                "--s3-secret-access-key-file",
                secret_path,
            ],
            "error sending request",
        ),
        // Refused credentials.
        (
            format!("s3://{bucket}{root}/b"),
            vec![
                "--s3-endpoint",
                endpoint,
                "--s3-access-key-id",
                "not-a-key",
                "--s3-secret-access-key-file",
                secret_path,
            ],
            "403",
        ),
        // A bucket that does not exist.
        (
            format!("s3://no-such-bucket-{}{root}/c", std::process::id()),
            vec![
                "--s3-endpoint",
                endpoint,
                "--s3-access-key-id",
                &key_id,
                "--s3-secret-access-key-file",
                secret_path,
            ],
            "NoSuchBucket",
        ),
    ];
    for (url, flags, why) in &cases {
        let mut args = vec!["gen", "--format", "dcp", "--size", "6MB", "--out", url];
        args.extend_from_slice(flags);
        let out = w.ferry(&args, &[], GEN).await;
        w.ensure(!out.success(), || {
            format!("ferry gen --out {url} should fail: {out}")
        });
        w.ensure(
            out.stderr.contains(&format!("--out {url}")) && out.stderr.contains(why),
            || {
                format!(
                    "ferry gen --out {url}: the error should name the URL and say {why:?}: {out}"
                )
            },
        );
        w.ensure(!out.all().contains(&secret), || {
            format!("the secret key was printed: {out}")
        });
        w.ensure(!out.stderr.contains("panicked"), || {
            format!("a panic: {out}")
        });
    }
    // Nothing was written where the credentials were refused (S3 answers
    // an empty prefix as not found).
    match store.list(Path::new(&root), &[]) {
        Ok(listed) => w.ensure(listed.files.is_empty(), || {
            format!("files were written under {root}: {:?}", listed.files)
        }),
        Err(ScanError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => w.fail(format!("listing {root}: {e}")),
    }
    // A save into a directory that holds one already is refused.
    let url = format!("s3://{bucket}{root}/twice");
    let args = [
        "gen",
        "--format",
        "dcp",
        "--size",
        "6MB",
        "--out",
        &url,
        "--s3-endpoint",
        endpoint,
        "--s3-access-key-id",
        &key_id,
        "--s3-secret-access-key-file",
        secret_path,
    ];
    let out = w.ferry(&args, &[], GEN).await;
    w.ensure(out.success(), || format!("ferry gen --out {url}: {out}"));
    let out = w.ferry(&args, &[], GEN).await;
    w.ensure(
        !out.success() && out.stderr.contains("exists and is not empty"),
        || format!("a second save into {url} should be refused: {out}"),
    );
}
