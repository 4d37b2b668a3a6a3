//! Publish cost of a replica of many small files at an HDFS sink (a
//! MiniDFSCluster) and an S3 sink (SeaweedFS): the sink's last step, the
//! read-back of staging against the manifest and the assembly (HDFS) or
//! the object writes (S3), timed with the files taken one at a time and
//! `--threads` at once, alternating, in one invocation. Run through
//! `ops/bench/publish`, which starts the servers (`ops/with-test-servers`)
//! and passes their addresses in FERRY_TEST_HDFS_URL, FERRY_TEST_S3_URL
//! and the S3 key pair.
//!
//! The checkpoint is synthetic: `--files` files, about two thirds of them
//! 1-16 KiB (the generator's small-file share), the rest sharing the
//! remaining bytes of `--size-mb`. Each run stages it afresh in order, as
//! the sink does when chunks arrive in order, then times one
//! `SinkStore::publish` with the read-back on (the default).
//!
//! Last, per store, it times what a re-save costs the sink for files that
//! did not change: `SinkStore::share_unchanged` of every file of the last
//! published replica into a new staging area, 8 files at once as the
//! sink does (HDFS: a copy inside the cluster, here of every file, though
//! the sink sends files under 64 MiB again; S3: a record of the object to
//! keep), against sending those bytes over a 1 Gbit/s link.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use ferry_proto::manifest::{chunk_count, chunk_len, Manifest, DEFAULT_CHUNK_SIZE};
use replicator::storage::hdfs::Hdfs;
use replicator::storage::posix::Posix;
use replicator::storage::s3::S3;
use replicator::storage::{PublishOutcome, SinkStore};

/// Publish time of a many-small-files replica on HDFS and S3, one file
/// at a time against several at once.
#[derive(Parser, Debug)]
struct Args {
    /// Files in the checkpoint.
    #[arg(long, default_value_t = 434)]
    files: usize,
    /// Bytes in the checkpoint, MB (10^6 bytes).
    #[arg(long, default_value_t = 100)]
    size_mb: u64,
    /// Timed publishes per setting and store.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Files at once in the parallel setting (the sink's default is 8).
    #[arg(long, default_value_t = replicator::storage::remote::PUBLISH_THREADS)]
    threads: usize,
    /// HDFS: files whose closes a staging area runs together (the sink's
    /// default is 64; 1 closes each file before the next one opens).
    #[arg(long, default_value_t = 64)]
    staging_closes: usize,
    /// Only these stores (comma-separated: hdfs, s3).
    #[arg(long, default_value = "hdfs,s3")]
    only: String,
}

fn env(var: &str) -> Result<String> {
    ferry_bench::servers::env(var, "ops/bench/publish")
}

/// Writes the synthetic checkpoint into `dir`; returns its bytes.
fn write_checkpoint(dir: &Path, a: &Args) -> Result<u64> {
    let total = a.size_mb * 1_000_000;
    let small = a.files * 2 / 3;
    let sizes: Vec<u64> = (0..a.files)
        .map(|i| {
            if i < small {
                1024 + (i as u64 * 7919) % (15 * 1024)
            } else {
                0
            }
        })
        .collect();
    let small_bytes: u64 = sizes.iter().sum();
    let large = (a.files - small).max(1) as u64;
    let each = total.saturating_sub(small_bytes) / large;
    let mut written = 0;
    for (i, s) in sizes.iter().enumerate() {
        let n = if i < small { *s } else { each };
        let p = dir.join(format!("shard-{:02}/tensor-{i:05}.bin", i % 16));
        std::fs::create_dir_all(p.parent().context("a file has a parent")?)?;
        let data: Vec<u8> = (0..n)
            .map(|j| (j as u8).wrapping_mul(31) ^ i as u8)
            .collect();
        std::fs::write(&p, &data)?;
        written += n;
    }
    Ok(written)
}

/// Stages every chunk of `m` (read from `local`) in order into `staging`.
fn stage(store: &dyn SinkStore, local: &Path, staging: &Path, m: &Manifest) -> Result<()> {
    let mut st = store.staging(staging);
    for f in &m.files {
        let bytes = std::fs::read(local.join(&f.path))?;
        for ci in 0..chunk_count(f.size, m.chunk_size) {
            let off = ci * u64::from(m.chunk_size);
            let len = chunk_len(f.size, m.chunk_size, ci);
            st.stage_chunk(&f.path, off, &bytes[off as usize..(off + len) as usize])
                .with_context(|| format!("staging {}", f.path))?;
        }
    }
    st.finish().context("finishing staging")?;
    Ok(())
}

/// Stages and publishes `m` `a.runs` times for each setting (1 and
/// `a.threads` files at once), alternating; prints each and the medians.
fn measure(
    name: &str,
    open: &dyn Fn(usize) -> Result<Box<dyn SinkStore>>,
    base: &Path,
    local: &Path,
    m: &Manifest,
    a: &Args,
) -> Result<()> {
    let reread: Vec<(u64, ferry_proto::manifest::Hash)> = m
        .files
        .iter()
        .flat_map(|f| f.chunks.iter().copied())
        .enumerate()
        .map(|(i, h)| (i as u64, h))
        .collect();
    let settings = [1, a.threads.max(1)];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); 2];
    for run in 0..a.runs {
        // Alternate which setting goes first.
        for k in [run % 2, 1 - run % 2] {
            let threads = settings[k];
            let store = open(threads)?;
            let staging = base.join(format!("staging-{run}-{threads}"));
            let replica = base.join(format!("replica-{run}-{threads}"));
            let version = base.join(format!("versions/{run}-{threads}"));
            let t = Instant::now();
            stage(&*store, local, &staging, m)?;
            let staged = t.elapsed();
            let t = Instant::now();
            let out = store
                .publish(&staging, &replica, &version, m, Some(&reread), None)
                .with_context(|| format!("{name}: publishing {}", replica.display()))?;
            let took = t.elapsed();
            anyhow::ensure!(
                matches!(out, PublishOutcome::Published { .. }),
                "{name}: the publish answered {out:?}"
            );
            println!(
                "{name:<5} run {run}: staged in order in {:.2} s; {threads} file(s) at once: publish {:.2} s",
                staged.as_secs_f64(),
                took.as_secs_f64()
            );
            times[k].push(took);
        }
    }
    // A re-save with every file unchanged: each shared with the last
    // replica instead of crossing the WAN again.
    let store = open(settings[1])?;
    let last = base.join(format!("replica-{}-{}", a.runs - 1, settings[1]));
    let staging = base.join("staging-shared");
    let t = Instant::now();
    // As the sink does: several files at once.
    replicator::storage::remote::for_each_parallel(
        replicator::storage::remote::PUBLISH_THREADS,
        m.files.len(),
        |i| {
            let f = &m.files[i];
            store
                .share_unchanged(&last, &staging, &f.path)
                .map_err(|e| {
                    std::io::Error::new(e.kind(), format!("{name}: sharing {}: {e}", f.path))
                })
        },
    )?;
    let shared = t.elapsed().as_secs_f64();
    let bytes: u64 = m.files.iter().map(|f| f.size).sum();
    println!(
        "{name:<5} sharing {} unchanged files ({bytes} bytes) with the published version: {shared:.2} s \
         ({:.0} MB/s; the same bytes take {:.2} s at 1 Gbit/s)",
        m.files.len(),
        bytes as f64 / 1e6 / shared.max(1e-9),
        bytes as f64 * 8.0 / 1e9
    );
    store.discard(&staging)?;
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2].as_secs_f64()
    };
    let (one, many) = (median(&mut times[0]), median(&mut times[1]));
    println!(
        "{name:<5} {} files: median publish {one:.2} s one at a time, {many:.2} s {} at once \
         ({:.1} x faster)",
        m.files.len(),
        settings[1],
        one / many.max(1e-9)
    );
    Ok(())
}

fn main() -> Result<()> {
    let a = Args::parse();
    anyhow::ensure!(
        a.runs > 0 && a.files > 0,
        "--runs and --files must be positive"
    );
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis();
    let local = std::env::temp_dir().join(format!("ferry-bench-publish-{}", std::process::id()));
    std::fs::create_dir_all(&local)?;
    let bytes = write_checkpoint(&local, &a)?;
    let m = replicator::storage::build(&Posix, &local, &[], DEFAULT_CHUNK_SIZE)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", local.display()))?;
    eprintln!(
        "checkpoint: {} files, {bytes} bytes, {} chunks",
        m.files.len(),
        m.files.iter().map(|f| f.chunks.len()).sum::<usize>()
    );
    let only: Vec<&str> = a.only.split(',').map(str::trim).collect();
    let base = PathBuf::from(format!("/ferry-bench/publish-{stamp}"));
    let result = (|| -> Result<()> {
        if only.contains(&"hdfs") {
            let nn = env("FERRY_TEST_HDFS_URL")?;
            Hdfs::connect(&nn, None)?.put_file(&base.join("README"), b"bench root")?;
            let url = format!("{nn}{}", base.display());
            let open = |n: usize| -> Result<Box<dyn SinkStore>> {
                Ok(Box::new(
                    Hdfs::connect(&url, None)?
                        .with_publish_threads(n)
                        .with_staging_closes(a.staging_closes)
                        .with_share_min(0),
                ))
            };
            measure("hdfs", &open, &base, &local, &m, &a)?;
        }
        if only.contains(&"s3") {
            let (bucket, cfg) = ferry_bench::servers::s3("ops/bench/publish")?;
            let url = format!("s3://{bucket}{}", base.display());
            let open = |n: usize| -> Result<Box<dyn SinkStore>> {
                Ok(Box::new(S3::connect(&url, &cfg)?.with_publish_threads(n)))
            };
            measure("s3", &open, &base, &local, &m, &a)?;
        }
        Ok(())
    })();
    std::fs::remove_dir_all(&local)?;
    result
}
