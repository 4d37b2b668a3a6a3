//! `ferry gen --out hdfs://namenode:port/dir` or `--out s3://bucket/prefix`:
//! the generator's [`Output`] on the remote stores of
//! [`replicator::storage`]. Files are written whole, one after the other:
//! on HDFS sequentially, each piece (at most 1 MiB) sent to the DataNodes
//! before the next is made; on S3 object by object, one PUT up to 8 MiB,
//! else a multipart upload of 8 MiB parts sent as they fill. Memory stays
//! at one piece and one part, whatever the file's size.
//!
//! Closing an HDFS file waits for the NameNode to complete its last block
//! (with `hdfs-native` 0.14, often a 500 ms retry), so one close after
//! another cost about half a second per small file. The closes of up to
//! [`PENDING_CLOSES`] finished files run together instead, at the
//! generator's barriers ([`Output::barrier`]: before markers, removals
//! and the end) or when that many wait.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use ferry_gen::output::{Output, OutputFile};
use replicator::storage::hdfs::{Hdfs, HdfsWriter};
use replicator::storage::remote::RemoteRoot;
use replicator::storage::s3::{S3Config, S3Writer, S3};
use replicator::storage::{ScanError, SourceStore};

/// Whether `--out` names a remote store (`scheme://...`) rather than a
/// local directory.
pub fn is_remote(out: &Path) -> bool {
    out.to_str().is_some_and(|s| s.contains("://"))
}

/// The endpoint and credentials of an `s3://` `--out`, as `[sink.s3]`
/// has them; unset fields come from the `AWS_*` environment variables.
#[derive(Debug, Clone, Default)]
pub struct S3Settings {
    /// Endpoint URL (`http://127.0.0.1:8333`); unset: `AWS_ENDPOINT`, or
    /// AWS S3 itself.
    pub endpoint: Option<String>,
    /// Region; unset: `AWS_REGION`, or `us-east-1`.
    pub region: Option<String>,
    /// Access key id; unset: `AWS_ACCESS_KEY_ID`.
    pub access_key_id: Option<String>,
    /// File holding the secret access key (one line); unset:
    /// `AWS_SECRET_ACCESS_KEY`. The key is never printed.
    pub secret_access_key_file: Option<PathBuf>,
}

impl S3Settings {
    /// Whether any field is set.
    pub fn is_set(&self) -> bool {
        self.endpoint.is_some()
            || self.region.is_some()
            || self.access_key_id.is_some()
            || self.secret_access_key_file.is_some()
    }

    /// The store's configuration, with the secret key read from its file.
    ///
    /// # Errors
    /// The key file cannot be read (named) or is empty.
    pub fn config(&self) -> Result<S3Config> {
        let secret_access_key = match &self.secret_access_key_file {
            Some(f) => {
                let key = std::fs::read_to_string(f)
                    .with_context(|| format!("--s3-secret-access-key-file {}", f.display()))?
                    .trim()
                    .to_string();
                if key.is_empty() {
                    bail!("--s3-secret-access-key-file {}: empty", f.display());
                }
                Some(key)
            }
            None => None,
        };
        Ok(S3Config {
            endpoint: self.endpoint.clone(),
            region: self.region.clone(),
            access_key_id: self.access_key_id.clone(),
            secret_access_key,
            capacity: None,
        })
    }
}

#[derive(Debug)]
enum Store {
    Hdfs(Hdfs),
    S3(S3),
}

/// Finished HDFS files whose closes run together by default (see the
/// module's documentation).
pub use replicator::storage::hdfs::PENDING_CLOSES;

/// Finished HDFS files not yet closed: (path, writer).
type Pending = Arc<Mutex<Vec<(PathBuf, HdfsWriter)>>>;

/// A root in HDFS or S3 that the generator writes into, paths relative to
/// it.
#[derive(Debug)]
pub struct RemoteOut {
    url: String,
    /// The root's path in the store (`/ckpt/job`).
    root: PathBuf,
    store: Store,
    pending: Pending,
    /// How many finished HDFS files may wait for their close.
    pending_closes: usize,
}

impl RemoteOut {
    /// Opens `url` (`hdfs://namenode:port/dir`, `s3://bucket/prefix`)
    /// and checks that the store answers: the NameNode (the directory
    /// need not exist; it is made with the first file), or the endpoint,
    /// the credentials and the bucket (a listing of the prefix). Blocks;
    /// call it where blocking is allowed.
    ///
    /// # Errors
    /// A URL that does not parse; an unreachable NameNode or endpoint,
    /// refused credentials, a missing bucket; each naming `url`.
    pub fn open(url: &str, s3: &S3Settings) -> Result<RemoteOut> {
        let parsed = RemoteRoot::parse(url).map_err(|e| anyhow!("--out: {e}"))?;
        let url = parsed.url.clone();
        let store = match parsed.scheme.as_str() {
            "hdfs" => {
                if s3.is_set() {
                    bail!("--out {url}: the --s3-* options apply to an s3:// --out only");
                }
                // Opened at the name space's root, so that `--out` may be
                // a directory that does not exist yet, as a local one.
                let nn = format!("hdfs://{}/", parsed.authority);
                Store::Hdfs(Hdfs::connect(&nn, None).map_err(|e| anyhow!("--out {url}: {e}"))?)
            }
            _ => Store::S3(
                S3::connect(&url, &s3.config()?).map_err(|e| anyhow!("--out {url}: {e}"))?,
            ),
        };
        Ok(RemoteOut {
            url,
            root: parsed.path,
            store,
            pending: Pending::default(),
            pending_closes: PENDING_CLOSES,
        })
    }

    /// Closes HDFS files one at a time, as each is finished (`n` = 1), or
    /// up to `n` together; for measuring what closing together saves.
    pub fn with_pending_closes(mut self, n: usize) -> RemoteOut {
        self.pending_closes = n.max(1);
        self
    }

    /// Closes every finished HDFS file not yet closed, together.
    fn close_pending(&self) -> io::Result<()> {
        let all = std::mem::take(&mut *lock(&self.pending));
        HdfsWriter::close_together(all.into_iter().map(|(_, w)| w).collect())
    }

    /// The root's URL, without a trailing `/`.
    pub fn url(&self) -> &str {
        &self.url
    }

    fn path(&self, rel: &Path) -> PathBuf {
        self.root.join(rel)
    }

    /// Whether no file is under `rel` (a directory or key prefix; `""`
    /// for the root). Blocks.
    ///
    /// # Errors
    /// The store's error, naming the URL.
    pub fn is_empty(&self, rel: &Path) -> Result<bool> {
        let dir = self.path(rel);
        let listed = match &self.store {
            Store::Hdfs(h) => h.list(&dir, &[]),
            Store::S3(s) => s.list(&dir, &[]),
        };
        match listed {
            Ok(l) => Ok(l.files.is_empty()),
            Err(ScanError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                Ok(true)
            }
            Err(e) => Err(anyhow!("--out {}: {e}", self.url)),
        }
    }
}

impl Output for RemoteOut {
    fn create(&self, rel: &Path, size: u64) -> io::Result<Box<dyn OutputFile>> {
        let path = self.path(rel);
        Ok(match &self.store {
            Store::Hdfs(h) => {
                if lock(&self.pending).iter().any(|(p, _)| *p == path) {
                    // Its earlier writer holds the file's lease until closed.
                    self.close_pending()?;
                }
                Box::new(HdfsOut {
                    path: path.clone(),
                    writer: h.create_file(&path)?,
                    pending: self.pending.clone(),
                    max: self.pending_closes,
                })
            }
            Store::S3(s) => Box::new(S3Out(s.create_file(&path, size)?)),
        })
    }

    fn remove(&self, rel: &Path) -> io::Result<()> {
        let path = self.path(rel);
        match &self.store {
            Store::Hdfs(h) => h.remove_file(&path).map(drop),
            Store::S3(s) => s.remove_file(&path),
        }
    }

    fn barrier(&self) -> io::Result<()> {
        self.close_pending()
    }
}

impl Drop for RemoteOut {
    fn drop(&mut self) {
        if let Err(e) = self.close_pending() {
            tracing::warn!(error = %e, "closing HDFS files the generator wrote");
        }
    }
}

/// The pending closes, even if a thread panicked holding them.
fn lock(p: &Pending) -> std::sync::MutexGuard<'_, Vec<(PathBuf, HdfsWriter)>> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

struct HdfsOut {
    path: PathBuf,
    writer: HdfsWriter,
    pending: Pending,
    max: usize,
}

impl OutputFile for HdfsOut {
    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.writer.write(bytes)
    }

    fn finish(self: Box<Self>) -> io::Result<()> {
        let HdfsOut {
            path,
            writer,
            pending,
            max,
        } = *self;
        let full = {
            let mut p = lock(&pending);
            p.push((path, writer));
            if p.len() >= max {
                std::mem::take(&mut *p)
            } else {
                Vec::new()
            }
        };
        HdfsWriter::close_together(full.into_iter().map(|(_, w)| w).collect())
    }

    fn abandon(self: Box<Self>) -> io::Result<bool> {
        // A killed writer's file keeps what reached the DataNodes.
        self.writer.close().map(|()| true)
    }
}

struct S3Out(S3Writer);

impl OutputFile for S3Out {
    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.0.write(bytes)
    }

    fn finish(self: Box<Self>) -> io::Result<()> {
        self.0.close()
    }

    fn abandon(self: Box<Self>) -> io::Result<bool> {
        // Dropped: a multipart upload is aborted, a PUT never sent.
        Ok(false)
    }
}
