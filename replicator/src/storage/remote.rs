//! What the HDFS and S3 backends share: the async bridge (both clients are
//! async, the storage seams are not), how a root URL maps onto the seams'
//! paths, listing order, and the layout of a staging area built from
//! chunk files.
//!
//! **Paths.** A remote store is opened for one root URL
//! (`hdfs://nn:8020/ckpt/job`, `s3://bucket/prefix`). The `&Path`
//! arguments of [`SourceStore`](super::SourceStore) and
//! [`SinkStore`](super::SinkStore) are then the path part of URLs in that
//! store: `/ckpt/job/step-100` is `hdfs://nn:8020/ckpt/job/step-100`, and
//! `/prefix/step-100` is the key prefix `prefix/step-100/` of the bucket.
//! A path that is not absolute, contains `.` or `..`, or lies outside the
//! root is refused with an error naming the root
//! ([`RemoteRoot::check`]).
//!
//! **Staging.** Chunks arrive out of order from several streams, and
//! neither store writes at an offset, so each chunk is staged as its own
//! file (HDFS) or object (S3) at `<staging>/.ferry-chunks/<rel>/<offset>`
//! (offset as 20 decimal digits, so names sort by offset). A publish
//! assembles each file from its chunks in order ([`chunk_key`]). What is
//! staged is listed again after a restart, so a resumed transfer keeps it.

use std::future::Future;
use std::io;
use std::path::{Component, Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use super::{Listed, Listing};

/// How long one call to a storage server may take before it fails with
/// `TimedOut` naming the root (an unreachable NameNode or endpoint must
/// not hang a transfer).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// Directory (HDFS) or key prefix (S3) under a staging area holding one
/// file or object per staged chunk.
pub const CHUNKS_DIR: &str = ".ferry-chunks";

/// The tokio runtime the remote stores run their clients on: two worker
/// threads named `ferry-storage`, created on first use.
fn runtime() -> io::Result<&'static tokio::runtime::Runtime> {
    static RT: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ferry-storage")
            .enable_all()
            .build()
            .map_err(|e| e.to_string())
    })
    .as_ref()
    .map_err(|e| io::Error::other(format!("starting the storage runtime: {e}")))
}

/// A handle of the storage runtime, for clients that spawn tasks of their
/// own.
///
/// # Errors
/// When the runtime cannot start (no threads).
pub fn runtime_handle() -> io::Result<tokio::runtime::Handle> {
    Ok(runtime()?.handle().clone())
}

/// Runs `fut` on the storage runtime and blocks the calling thread until
/// it is done, failing with `TimedOut` after [`CALL_TIMEOUT`]. Safe from
/// any thread that may block (a plain thread or tokio's blocking pool):
/// the future runs on the storage runtime's own workers, never on the
/// caller's, so this never nests one runtime's `block_on` in another.
///
/// # Errors
/// `TimedOut` naming `what`; an error when the runtime cannot start or the
/// task panicked.
pub fn block_on<T: Send + 'static>(
    what: &str,
    fut: impl Future<Output = io::Result<T>> + Send + 'static,
) -> io::Result<T> {
    let rt = runtime()?;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    rt.spawn(async move {
        let r = match tokio::time::timeout(CALL_TIMEOUT, fut).await {
            Ok(r) => r,
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer within {} s", CALL_TIMEOUT.as_secs()),
            )),
        };
        let _ = tx.send(r);
    });
    rx.recv()
        .map_err(|_| io::Error::other(format!("{what}: the storage task failed")))?
        .map_err(|e| io::Error::new(e.kind(), format!("{what}: {e}")))
}

/// Files a publish on a remote store assembles, reads back or writes at
/// once: each file is a few round trips to the NameNode and DataNodes or
/// to the S3 endpoint, which threads overlap (thousands of small files
/// one after another take seconds of round trips alone).
pub const PUBLISH_THREADS: usize = 8;

/// The index of each file's first chunk among all of `m`'s chunks, in
/// manifest order (where its keys start in a read-back list).
pub fn first_chunks(m: &ferry_proto::manifest::Manifest) -> Vec<usize> {
    m.files
        .iter()
        .scan(0usize, |acc, f| {
            let first = *acc;
            *acc += f.chunks.len();
            Some(first)
        })
        .collect()
}

/// Calls `f(i)` for every `i` in `0..n` on up to `threads` threads (the
/// calling thread waits); items are taken in order, each once.
///
/// # Errors
/// The first error `f` returns; the other threads stop at their next
/// item.
pub fn for_each_parallel(
    threads: usize,
    n: usize,
    f: impl Fn(usize) -> io::Result<()> + Sync,
) -> io::Result<()> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_err = std::sync::Mutex::new(None::<io::Error>);
    let work = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= n || failed.load(Ordering::Relaxed) {
            return;
        }
        if let Err(e) = f(i) {
            failed.store(true, Ordering::Relaxed);
            first_err
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get_or_insert(e);
            return;
        }
    };
    std::thread::scope(|sc| {
        for _ in 0..threads.clamp(1, n.max(1)) {
            sc.spawn(work);
        }
    });
    match first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// A root URL of a remote store, split into the store (`hdfs://nn:8020`,
/// `s3://bucket`) and the root path inside it (`/ckpt/job`, `/prefix`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteRoot {
    /// The URL as configured, for messages (`hdfs://nn:8020/ckpt/job`).
    pub url: String,
    /// `hdfs` or `s3`.
    pub scheme: String,
    /// NameNode `host:port` (or name service) for HDFS, bucket for S3.
    pub authority: String,
    /// Absolute path of the root in the store, without a trailing `/`
    /// (`/` for the whole store).
    pub path: PathBuf,
}

impl RemoteRoot {
    /// Parses `scheme://authority/path`.
    ///
    /// # Errors
    /// `InvalidInput` naming the URL when the scheme is not `hdfs` or
    /// `s3`, the authority is empty, or the path has `.` or `..`.
    pub fn parse(url: &str) -> io::Result<RemoteRoot> {
        let bad = |why: &str| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("storage root {url}: {why}"),
            )
        };
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad("not a URL (hdfs://namenode:port/dir or s3://bucket/prefix)"))?;
        if scheme != "hdfs" && scheme != "s3" {
            return Err(bad("scheme must be hdfs or s3"));
        }
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        if authority.is_empty() {
            return Err(bad(if scheme == "s3" {
                "no bucket"
            } else {
                "no NameNode"
            }));
        }
        let path = format!("/{}", path.trim_end_matches('/'));
        let root = RemoteRoot {
            url: url.trim_end_matches('/').to_string(),
            scheme: scheme.to_string(),
            authority: authority.to_string(),
            path: PathBuf::from("/"),
        };
        let path = root.check_form(Path::new(&path))?;
        Ok(RemoteRoot { path, ..root })
    }

    fn check_form(&self, p: &Path) -> io::Result<PathBuf> {
        let bad = || {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: not a plain absolute path in storage root {}",
                    p.display(),
                    self.url
                ),
            )
        };
        let s = p.to_str().ok_or_else(bad)?;
        if !p.is_absolute() || s.contains("//") {
            return Err(bad());
        }
        for c in p.components() {
            match c {
                Component::RootDir | Component::Normal(_) => {}
                _ => return Err(bad()),
            }
        }
        Ok(PathBuf::from(if s.len() > 1 {
            s.trim_end_matches('/')
        } else {
            s
        }))
    }

    /// Checks that `p` is a plain absolute path at or under the root and
    /// returns it as the store's path string (`/ckpt/job/x`).
    ///
    /// # Errors
    /// `InvalidInput` naming `p` and the root URL.
    pub fn check(&self, p: &Path) -> io::Result<String> {
        let p = self.check_form(p)?;
        if !p.starts_with(&self.path) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: outside storage root {}", p.display(), self.url),
            ));
        }
        Ok(p.to_string_lossy().into_owned())
    }

    /// Checks that version path `v` and published path `l` (store path
    /// strings, as [`RemoteRoot::check`] returns them) are apart: neither
    /// is `l` itself or inside the other, as a version kept beside its
    /// published path must be.
    ///
    /// # Errors
    /// `InvalidInput` naming both URLs.
    pub fn check_apart(&self, v: &str, l: &str) -> io::Result<()> {
        let (vp, lp) = (Path::new(v), Path::new(l));
        if vp.starts_with(lp) || lp.starts_with(vp) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: a version must be apart from the published path {}",
                    self.url_of(vp),
                    self.url_of(lp)
                ),
            ));
        }
        Ok(())
    }

    /// The URL of path `p` of this store (`hdfs://nn:8020/ckpt/job/x`).
    pub fn url_of(&self, p: &Path) -> String {
        format!("{}://{}{}", self.scheme, self.authority, p.display())
    }
}

/// Puts a listing in transfer order: non-markers sorted by path, then the
/// files named in `markers`, in that order (as the POSIX scan does).
pub fn order(mut files: Vec<Listed>, markers: &[String]) -> Listing {
    let rank = |p: &str| {
        let name = p.rsplit('/').next().unwrap_or(p);
        markers.iter().position(|m| m == name)
    };
    files.sort_by(|a, b| {
        let ka = (rank(&a.info.path).map_or(0, |r| r + 1), &a.info.path);
        let kb = (rank(&b.info.path).map_or(0, |r| r + 1), &b.info.path);
        ka.cmp(&kb)
    });
    let idx = files
        .iter()
        .enumerate()
        .filter(|(_, f)| rank(&f.info.path).is_some())
        .map(|(i, _)| i as u32)
        .collect();
    Listing {
        files,
        markers: idx,
    }
}

/// Whether a relative path has a component that is a temporary
/// ([`ferry_proto::paths::is_temporary`]) or Ferry's own
/// (`.ferry-*`): such files are never listed as part of a checkpoint.
pub fn skipped(rel: &str) -> bool {
    rel.split('/')
        .any(|c| ferry_proto::paths::is_temporary(c) || c.starts_with(".ferry-"))
}

/// The path of the chunk of file `rel` at byte `offset` in staging area
/// `staging` (a store path string).
pub fn chunk_key(staging: &str, rel: &str, offset: u64) -> String {
    format!("{staging}/{CHUNKS_DIR}/{rel}/{offset:020}")
}

/// The byte offset a chunk key names, if it is one.
pub fn chunk_offset(name: &str) -> Option<u64> {
    (name.len() == 20 && name.bytes().all(|b| b.is_ascii_digit()))
        .then(|| name.parse().ok())
        .flatten()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn roots_parse_and_paths_stay_inside() {
        let r = RemoteRoot::parse("hdfs://nn:8020/ckpt/job/").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(r.authority, "nn:8020");
        assert_eq!(r.path, Path::new("/ckpt/job"));
        assert_eq!(
            r.check(Path::new("/ckpt/job/a/b")).ok().as_deref(),
            Some("/ckpt/job/a/b")
        );
        assert!(r.check(Path::new("/ckpt/other")).is_err());
        assert!(r.check(Path::new("/ckpt/job/../x")).is_err());
        assert!(r.check(Path::new("ckpt/job/x")).is_err());
        let e = r.check(Path::new("/etc")).unwrap_err().to_string();
        assert!(e.contains("hdfs://nn:8020/ckpt/job"), "{e}");
        assert_eq!(
            r.url_of(Path::new("/ckpt/job/x")),
            "hdfs://nn:8020/ckpt/job/x"
        );
        let s = RemoteRoot::parse("s3://bucket").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (s.authority.as_str(), s.path.as_path()),
            ("bucket", Path::new("/"))
        );
        assert!(RemoteRoot::parse("s3:///x").is_err());
        assert!(RemoteRoot::parse("ftp://x/y").is_err());
        assert!(RemoteRoot::parse("/local").is_err());
    }

    #[test]
    fn chunk_keys_sort_by_offset() {
        let a = chunk_key("/s", "d/f", 9);
        let b = chunk_key("/s", "d/f", 10);
        assert!(a < b);
        assert_eq!(chunk_offset(b.rsplit('/').next().unwrap_or("")), Some(10));
        assert_eq!(chunk_offset("12"), None);
        assert!(skipped("a/.ferry-chunks/x") && skipped("x.tmp") && !skipped("a/b.bin"));
    }
}
