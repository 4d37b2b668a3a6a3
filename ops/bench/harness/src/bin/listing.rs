//! Listing cost of a polled source root: how long one pass of the
//! watcher's listing (`SourceStore::list`, recursive) takes over a root of
//! N small files on HDFS (a MiniDFSCluster), S3 (SeaweedFS) and, for
//! reference, a local directory. Run through `ops/bench/listing`, which
//! starts the servers (`ops/with-test-servers`) and passes their addresses
//! in FERRY_TEST_HDFS_URL, FERRY_TEST_S3_URL and the S3 key pair.
//!
//! Prints, per store: the time to write the root (not the measurement),
//! then each timed listing and their median, and the commit-to-replica
//! lag bound of a polled root with the default timing: scan interval (2 s)
//! + quiet period (2 s) + listing + 2 RTT + 1 s (RTT given by `--rtt-ms`).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use replicator::storage::hdfs::Hdfs;
use replicator::storage::s3::S3;
use replicator::storage::SourceStore;

/// Listing cost of a polled root of many small files on HDFS, S3 and a
/// local directory.
#[derive(Parser, Debug)]
struct Args {
    /// Files in the root: checkpoint directories of `--per-dir` files
    /// each.
    #[arg(long, default_value_t = 100_000)]
    files: usize,
    /// Files per checkpoint directory.
    #[arg(long, default_value_t = 1_000)]
    per_dir: usize,
    /// Bytes per file. A listing's cost does not depend on it (names,
    /// sizes and times only); empty files fill an HDFS root about 10x
    /// faster (no block, no DataNode pipeline).
    #[arg(long, default_value_t = 0)]
    size: usize,
    /// Timed listings per store.
    #[arg(long, default_value_t = 5)]
    polls: usize,
    /// Writers filling the root at once.
    #[arg(long, default_value_t = 32)]
    writers: usize,
    /// Round-trip time (ms) of the link, for the lag bound.
    #[arg(long, default_value_t = 100)]
    rtt_ms: u64,
    /// Only these stores (comma-separated: hdfs, s3, posix).
    #[arg(long, default_value = "posix,hdfs,s3")]
    only: String,
}

/// Writes one whole file of a store.
type Put = Arc<dyn Fn(&Path, &[u8]) -> std::io::Result<()> + Send + Sync>;

fn env(var: &str) -> Result<String> {
    ferry_bench::servers::env(var, "ops/bench/listing")
}

/// Writes `files` files of `size` bytes under `root` with `put`, from
/// `writers` threads; prints progress every 10 %.
fn fill(put: Put, root: &Path, a: &Args) -> Result<Duration> {
    let start = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let data = vec![7u8; a.size];
    let mut handles = Vec::new();
    for _ in 0..a.writers.max(1) {
        let (put, next, done, data, root) = (
            put.clone(),
            next.clone(),
            done.clone(),
            data.clone(),
            root.to_path_buf(),
        );
        let (files, per_dir) = (a.files, a.per_dir.max(1));
        handles.push(std::thread::spawn(move || -> std::io::Result<()> {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= files {
                    return Ok(());
                }
                let p = root.join(format!("step_{:06}/shard-{:06}.bin", i / per_dir, i));
                put(&p, &data)?;
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if n % (files / 10).max(1) == 0 {
                    eprintln!("  written {n}/{files}");
                }
            }
        }));
    }
    for h in handles {
        h.join()
            .map_err(|_| anyhow::anyhow!("a writer panicked"))?
            .context("writing the root")?;
    }
    Ok(start.elapsed())
}

/// Lists `root` through `store` `polls` times; returns each duration.
fn polls(store: &dyn SourceStore, root: &Path, a: &Args) -> Result<Vec<Duration>> {
    let mut out = Vec::new();
    for _ in 0..a.polls {
        let t = Instant::now();
        let l = store
            .list(root, &[])
            .map_err(|e| anyhow::anyhow!("listing {}: {e}", root.display()))?;
        out.push(t.elapsed());
        anyhow::ensure!(
            l.files.len() == a.files,
            "listed {} files, wrote {}",
            l.files.len(),
            a.files
        );
    }
    Ok(out)
}

fn report(name: &str, wrote: Duration, times: &[Duration], a: &Args) {
    let mut s: Vec<f64> = times.iter().map(Duration::as_secs_f64).collect();
    s.sort_by(f64::total_cmp);
    let median = s[s.len() / 2];
    let lag = 2.0 + 2.0 + median + 2.0 * a.rtt_ms as f64 / 1000.0 + 1.0;
    println!(
        "{name:<6} {} files: written in {:.1} s; listing {} s (median {median:.2} s, {:.1} us/file); \
         lag bound of a polled root 2 s + 2 s + {median:.2} s + 2 x {} ms + 1 s = {lag:.1} s",
        a.files,
        wrote.as_secs_f64(),
        s.iter().map(|x| format!("{x:.2}")).collect::<Vec<_>>().join(" "),
        median * 1e6 / a.files as f64,
        a.rtt_ms,
    );
}

fn main() -> Result<()> {
    let a = Args::parse();
    anyhow::ensure!(
        a.polls > 0 && a.files > 0,
        "--polls and --files must be positive"
    );
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();
    let only: Vec<&str> = a.only.split(',').map(str::trim).collect();
    if only.contains(&"posix") {
        let d = tempfile_dir()?;
        let root = d.join("root");
        let put: Put = Arc::new(|p: &Path, b: &[u8]| {
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(p, b)
        });
        eprintln!("posix: writing {} files", a.files);
        let wrote = fill(put, &root, &a)?;
        let t = polls(&replicator::storage::posix::Posix, &root, &a)?;
        report("posix", wrote, &t, &a);
        std::fs::remove_dir_all(&d)?;
    }
    if only.contains(&"hdfs") {
        let base = env("FERRY_TEST_HDFS_URL")?;
        let root = PathBuf::from(format!("/ferry-bench/listing-{stamp}"));
        let h = Arc::new(Hdfs::connect(&base, None)?);
        let h2 = h.clone();
        let put: Put = Arc::new(move |p: &Path, b: &[u8]| h2.put_file(p, b));
        eprintln!("hdfs: writing {} files", a.files);
        let wrote = fill(put, &root, &a)?;
        let store = Hdfs::connect(&format!("{base}{}", root.display()), None)?;
        let t = polls(&store, &root, &a)?;
        report("hdfs", wrote, &t, &a);
    }
    if only.contains(&"s3") {
        let (bucket, cfg) = ferry_bench::servers::s3("ops/bench/listing")?;
        let root = PathBuf::from(format!("/ferry-bench/listing-{stamp}"));
        let s = Arc::new(S3::connect(&format!("s3://{bucket}"), &cfg)?);
        let s2 = s.clone();
        let put: Put = Arc::new(move |p: &Path, b: &[u8]| s2.put_file(p, b));
        eprintln!("s3: writing {} files", a.files);
        let wrote = fill(put, &root, &a)?;
        let store = S3::connect(&format!("s3://{bucket}{}", root.display()), &cfg)?;
        let t = polls(&store, &root, &a)?;
        report("s3", wrote, &t, &a);
    }
    Ok(())
}

/// A fresh directory under the system's temporary directory.
fn tempfile_dir() -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!("ferry-bench-listing-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
