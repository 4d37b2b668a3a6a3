//! The HDFS backend of the storage seams, with the pure-Rust `hdfs-native`
//! client (no JVM, no libhdfs). Paths are HDFS paths under the root URL
//! (see [`remote`](super::remote)).
//!
//! - **Listing**: a recursive `listStatus`; the version token is the
//!   file's length, mtime (ms), permission and block size
//!   (`hdfs-native` 0.14 does not expose the inode's file id, so a rewrite
//!   that restores both length and mtime goes unseen).
//! - **Staging**: HDFS files are append-only with one writer, and chunks
//!   may arrive out of order. A file is written in order, as one file
//!   under `<staging>/.ferry-files/`, while its chunks arrive in order;
//!   a chunk out of order is its own file under `<staging>/.ferry-chunks/`.
//!   A publish moves a file staged whole in order with a rename, and
//!   assembles any other by one sequential rewrite (its staged bytes read
//!   once and written once more: [`Hdfs::rewritten_bytes`]).
//! - **Publish**: the files are assembled in `<staging>/.ferry-out`, the
//!   markers in `<staging>/.ferry-markers/<i>`; then
//!   `<staging>/.ferry-placed` is created (a publish is under way), an
//!   older version at the published path is renamed aside, `.ferry-out`
//!   is renamed to the published path (one directory rename), the markers
//!   are renamed in one by one, last, and the older version is removed. A
//!   publish that a crash interrupted is finished from `.ferry-placed` on.
//! - **Versions** ([`Hdfs::with_versions`], `[sink.hdfs] versions`):
//!   HDFS has no rename exchange, so instead `.ferry-out` is renamed to
//!   the version directory the sink names (`<root>/.ferry/versions/<id>`),
//!   the markers in last, and the published path becomes a pointer file
//!   `<path>.ferry-version` holding that directory's path, replaced by one
//!   rename (the switch). An older version stays whole where it is (a
//!   reader lease's URL) until it is withdrawn (pointer first, then its
//!   directory renamed aside); a replica published in place before goes
//!   after the switch. The replica's URL is its version directory
//!   ([`SinkStore::replica_url`]); reads of the published path follow the
//!   pointer.
//! - **Sharing an unchanged file** of a re-save: a copy inside the
//!   cluster (HDFS has no hard links, `hdfs-native` no server-side copy):
//!   the published file is read and written into staging as its in-order
//!   file, in pieces of 8 MiB, so it does not cross the WAN again; the
//!   publish renames it like any file staged in order and reads it back
//!   ([`Hdfs::copied_bytes`] counts what this costs). Files under
//!   [`SHARE_MIN`] (64 MiB) are sent again instead: each copy's close
//!   waits for the NameNode, which costs small files more than the WAN.
//! - **Free space**: a configured capacity less what the root holds, or
//!   else the root's space quota less what it consumes; `None` without
//!   either.
//!
//! Kerberos and HA name services are configuration of the client
//! (`HADOOP_CONF_DIR`'s core-site.xml and hdfs-site.xml, a ticket cache),
//! not tested here.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use ferry_proto::manifest::{chunk_count, chunk_len, FileInfo, Hash, Manifest};
use hdfs_native::file::FileWriter;
use hdfs_native::{Client, HdfsError, WriteOptions};

use super::posix::publish::fault_point;
use super::remote::{self, block_on, chunk_key, RemoteRoot};
use super::{
    FileVersion, HotRaised, Listed, Listing, PublishOutcome, RangeRead, ReadBack, ScanError,
    SinkStore, SourceStore, Staging, Watch, WatchHandler,
};

/// An HDFS name space, opened at one root URL.
#[derive(Clone)]
pub struct Hdfs {
    root: RemoteRoot,
    client: Arc<Client>,
    capacity: Option<u64>,
    rewritten: Arc<AtomicU64>,
    /// Bytes copied to share unchanged files with a re-save.
    copied: Arc<AtomicU64>,
    hot: Option<HotFiles>,
    publish_threads: usize,
    /// Closes a staging area runs together ([`PENDING_CLOSES`]).
    staging_closes: usize,
    /// Smallest file (bytes) a re-save shares by a copy ([`SHARE_MIN`]).
    share_min: u64,
    /// Each version in its own directory, named by a pointer file
    /// ([`Hdfs::with_versions`]).
    versions: bool,
}

/// Names of the files every rank of an eval job reads when it starts
/// (DCP and torch_dist `.metadata`, Megatron `metadata.json` and
/// `common.pt`, DeepSpeed `mp_rank_*_model_states.pt`, HF
/// `*.index.json` and `config.json`), matched in any directory of a
/// checkpoint: the files whose default three HDFS replicas melt when
/// thousands of ranks start at once.
pub const HOT_NAMES: &[&str] = &[
    ".metadata",
    "metadata.json",
    "common.pt",
    "mp_rank_*_model_states.pt",
    "*.index.json",
    "config.json",
];

/// Readers one replica of a hot file serves, from the seed's guideline of
/// 64 replicas for 10,000 readers and 128 for 20,000: with 157,
/// `ceil(readers / 157)` gives both.
pub const READERS_PER_REPLICA: u64 = 157;

/// Which files of a replica at an HDFS sink get a higher replication
/// factor before the publish, and which.
#[derive(Debug, Clone)]
pub struct HotFiles {
    /// The replication factor they get.
    pub factor: u16,
    /// How long they keep it after the publish; then the sink sets them
    /// back to the factor they were written with.
    pub ttl: std::time::Duration,
    /// Readers one replica serves, and the DataNodes (the factor's
    /// ceiling), for a transfer that says its readers
    /// ([`HotFiles::factor_for_readers`]); `datanodes` 0: not sized.
    per_replica: u64,
    datanodes: u16,
    set: globset::GlobSet,
    /// Where to see the replicas placed, and how long to wait for them
    /// ([`HotFiles::placed_via`]); `None`: the publish does not wait.
    placement: Option<(String, std::time::Duration)>,
}

impl HotFiles {
    /// The [`HOT_NAMES`] in any directory, plus `extra` globs over paths
    /// relative to the checkpoint directory (`*` stays within one
    /// directory), at `factor` replicas for `ttl`.
    ///
    /// # Errors
    /// A glob that does not parse, named.
    pub fn new(
        factor: u16,
        extra: &[String],
        ttl: std::time::Duration,
    ) -> Result<HotFiles, String> {
        let mut b = globset::GlobSetBuilder::new();
        let names = HOT_NAMES.iter().map(|n| format!("**/{n}"));
        for g in names.chain(extra.iter().cloned()) {
            let glob = globset::GlobBuilder::new(&g)
                .literal_separator(true)
                .build()
                .map_err(|e| format!("hot file glob {g:?}: {e}"))?;
            b.add(glob);
        }
        let set = b.build().map_err(|e| e.to_string())?;
        Ok(HotFiles {
            factor,
            ttl,
            per_replica: READERS_PER_REPLICA,
            datanodes: 0,
            set,
            placement: None,
        })
    }

    /// Has each publish wait up to `wait` for HDFS to place the raised
    /// replicas of its hot files, seen through the NameNode's WebHDFS REST
    /// API at `webhdfs` (`http://namenode:9870`; Hadoop 3.3 or later for
    /// `GETFILEBLOCKLOCATIONS`): `hdfs-native` 0.14 keeps block locations
    /// to itself. The publish goes ahead either way once `wait` has
    /// passed; `HotRaised::placed` says what was seen.
    pub fn placed_via(mut self, webhdfs: &str, wait: std::time::Duration) -> HotFiles {
        self.placement = Some((webhdfs.trim_end_matches('/').to_string(), wait));
        self
    }

    /// Sizes the factor for transfers that say how many readers their
    /// replica expects: `ceil(readers / per_replica)`, at most
    /// `datanodes`.
    pub fn sized(mut self, per_replica: u64, datanodes: u16) -> HotFiles {
        self.per_replica = per_replica.max(1);
        self.datanodes = datanodes;
        self
    }

    /// The factor for a replica whose transfer said it expects `readers`
    /// (sized as [`HotFiles::sized`] says), else [`HotFiles::factor`]. A
    /// file already at or above it is left alone.
    pub fn factor_for_readers(&self, readers: Option<u64>) -> u16 {
        match readers {
            Some(r) if self.datanodes > 0 => {
                HotFiles::factor_for(r, self.per_replica, self.datanodes)
            }
            _ => self.factor,
        }
    }

    /// Whether publishes wait for the replicas to be placed
    /// ([`HotFiles::placed_via`]).
    pub fn waits(&self) -> bool {
        self.placement.is_some()
    }

    /// Whether the file at `rel` (relative to the checkpoint directory)
    /// is hot.
    pub fn matches(&self, rel: &str) -> bool {
        self.set.is_match(rel)
    }

    /// The factor for `readers` expected readers of each replica:
    /// `ceil(readers / per_replica)`, at most `datanodes` (a factor above
    /// the DataNode count only leaves blocks under-replicated).
    pub fn factor_for(readers: u64, per_replica: u64, datanodes: u16) -> u16 {
        let f = readers.div_ceil(per_replica.max(1));
        u16::try_from(f).unwrap_or(u16::MAX).min(datanodes)
    }
}

impl fmt::Debug for Hdfs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hdfs({})", self.root.url)
    }
}

/// An `hdfs-native` error as an I/O error of the same kind.
fn io_of(e: HdfsError) -> io::Error {
    match e {
        HdfsError::FileNotFound(p) => {
            io::Error::new(io::ErrorKind::NotFound, format!("not found: {p}"))
        }
        HdfsError::AlreadyExists(p) => {
            io::Error::new(io::ErrorKind::AlreadyExists, format!("already exists: {p}"))
        }
        HdfsError::IOError(e) => e,
        // The NameNode's Java exceptions, by class name.
        HdfsError::RPCError(class, msg) | HdfsError::FatalRPCError(class, msg) => {
            let kind = if class.ends_with("FileNotFoundException") {
                io::ErrorKind::NotFound
            } else if class.ends_with("FileAlreadyExistsException")
                || class.ends_with("AlreadyBeingCreatedException")
            {
                io::ErrorKind::AlreadyExists
            } else if class.ends_with("AccessControlException") {
                io::ErrorKind::PermissionDenied
            } else {
                io::ErrorKind::Other
            };
            io::Error::new(kind, format!("{class}: {msg}"))
        }
        e => io::Error::other(e.to_string()),
    }
}

/// ms since the epoch (HDFS) to ns.
fn ns_of_ms(ms: u64) -> i64 {
    (ms as i64).saturating_mul(1_000_000)
}

fn version_of(st: &hdfs_native::client::FileStatus) -> FileVersion {
    FileVersion([
        st.length as u64,
        st.modification_time,
        u64::from(st.permission),
        st.blocksize.unwrap_or(0),
    ])
}

impl Hdfs {
    /// Opens `url` (`hdfs://namenode:port/dir`) and checks that the
    /// NameNode answers and the root directory exists. `capacity` (bytes)
    /// is what a sink may fill under the root; `None` uses the root's
    /// space quota, if it has one.
    ///
    /// # Errors
    /// `InvalidInput` for a URL that is not `hdfs://`; the NameNode's
    /// error (unreachable, refused, `NotFound` for a missing root), each
    /// naming the root URL.
    pub fn connect(url: &str, capacity: Option<u64>) -> io::Result<Hdfs> {
        let root = RemoteRoot::parse(url)?;
        if root.scheme != "hdfs" {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("storage root {url}: not an hdfs:// URL"),
            ));
        }
        let handle = remote::runtime_handle()?;
        let nn = format!("hdfs://{}", root.authority);
        // Hadoop's default of 15 fail-overs with sleeps up to 15 s keeps a
        // call to an unreachable NameNode going for minutes; Ferry retries
        // whole transfers itself, so a call gives up after about 8 s.
        let client = hdfs_native::ClientBuilder::new()
            .with_url(nn)
            .with_config([
                ("dfs.client.failover.max.attempts", "4"),
                ("dfs.client.failover.sleep.base.millis", "500"),
                ("dfs.client.failover.sleep.max.millis", "4000"),
            ])
            .with_io_runtime(handle)
            .build()
            .map_err(|e| io::Error::other(format!("storage root {url}: {e}")))?;
        let h = Hdfs {
            root,
            client: Arc::new(client),
            capacity,
            rewritten: Arc::default(),
            copied: Arc::default(),
            hot: None,
            publish_threads: remote::PUBLISH_THREADS,
            staging_closes: PENDING_CLOSES,
            share_min: SHARE_MIN,
            versions: false,
        };
        let st = h.status(&h.root.path.clone()).map_err(|e| {
            if e.kind() == io::ErrorKind::NotFound {
                io::Error::new(
                    e.kind(),
                    format!(
                        "storage root {url}: directory {} does not exist in HDFS; create it \
                         (hdfs dfs -mkdir -p {}) or correct the URL",
                        h.root.path.display(),
                        h.root.path.display()
                    ),
                )
            } else {
                e
            }
        })?;
        if !st.isdir {
            return Err(io::Error::other(format!(
                "storage root {url}: not a directory"
            )));
        }
        Ok(h)
    }

    /// The root this store was opened at.
    pub fn root(&self) -> &RemoteRoot {
        &self.root
    }

    /// Runs one client call on the storage runtime; errors name `what`,
    /// the path and the root URL.
    fn call<T: Send + 'static, F>(
        &self,
        what: &str,
        path: &str,
        f: impl FnOnce(Arc<Client>, String) -> F,
    ) -> io::Result<T>
    where
        F: std::future::Future<Output = Result<T, HdfsError>> + Send + 'static,
    {
        let fut = f(self.client.clone(), path.to_string());
        block_on(&format!("{} {what} {path}", self.root.url), async move {
            fut.await.map_err(io_of)
        })
    }

    fn status(&self, p: &Path) -> io::Result<hdfs_native::client::FileStatus> {
        let p = self.root.check(p)?;
        self.call("stat", &p, |c, p| async move { c.get_file_info(&p).await })
    }

    fn exists_at(&self, p: &str) -> io::Result<bool> {
        match self.call("stat", p, |c, p| async move { c.get_file_info(&p).await }) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Writes `data` as the whole file at `p` (store path), replacing any
    /// file there, creating parents, with permission `mode`.
    fn write_whole(&self, p: &str, data: Bytes, mode: u32) -> io::Result<()> {
        self.call("write", p, move |c, p| async move {
            let opts = WriteOptions::default()
                .overwrite(true)
                .create_parent(true)
                .permission(mode & 0o777);
            let mut w = c.create(&p, opts).await?;
            Box::pin(w.write_bytes(data)).await?;
            Box::pin(w.close()).await
        })
    }

    fn read_whole(&self, p: &str) -> io::Result<Bytes> {
        self.call("read", p, |c, p| async move {
            let r = c.read(&p).await?;
            let len = r.file_length();
            r.read_range(0, len).await
        })
    }

    fn delete_tree(&self, p: &str) -> io::Result<()> {
        self.call("delete", p, |c, p| async move { c.delete(&p, true).await })
            .map(|_| ())
    }

    fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        let to = to.to_string();
        self.call("rename", from, move |c, from| async move {
            if let Some(parent) = Path::new(&to).parent().and_then(Path::to_str) {
                c.mkdirs(parent, 0o755, true).await?;
            }
            c.rename(&from, &to, false).await
        })
    }

    /// Writes `data` as the file at `path` (under the root), replacing any
    /// file there: for tests and the generator.
    ///
    /// # Errors
    /// The NameNode's or DataNode's error, naming the path and root.
    pub fn put_file(&self, path: &Path, data: &[u8]) -> io::Result<()> {
        let p = self.root.check(path)?;
        self.write_whole(&p, Bytes::copy_from_slice(data), 0o644)
    }

    /// Creates the file at `path` with `data` only if no file is there:
    /// `Ok(true)` when this call created it, `Ok(false)` when it existed
    /// (HDFS's create without overwrite, decided by the NameNode).
    ///
    /// # Errors
    /// Other errors of the NameNode, naming the path and root.
    pub fn put_if_absent(&self, path: &Path, data: &[u8]) -> io::Result<bool> {
        let p = self.root.check(path)?;
        let data = Bytes::copy_from_slice(data);
        match self.call("create", &p, move |c, p| async move {
            let opts = WriteOptions::default().overwrite(false).create_parent(true);
            let mut w = c.create(&p, opts).await?;
            Box::pin(w.write_bytes(data)).await?;
            Box::pin(w.close()).await
        }) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Sets the mtime (ns since the epoch, kept to the ms) of the file at
    /// `path`.
    ///
    /// # Errors
    /// The NameNode's error, naming the path and root.
    pub fn set_mtime(&self, path: &Path, mtime_ns: i64) -> io::Result<()> {
        let p = self.root.check(path)?;
        let ms = (mtime_ns.max(0) / 1_000_000) as u64;
        self.call("set_times", &p, move |c, p| async move {
            c.set_times(&p, ms, ms).await
        })
    }

    /// Creates the file at `path` (under the root) for writing in order,
    /// replacing any file there and creating its parents (mode 0644): for
    /// the generator. Memory stays at one piece: each
    /// [`HdfsWriter::write`] goes out to the DataNodes before it returns.
    ///
    /// # Errors
    /// The NameNode's error, naming the path and root.
    pub fn create_file(&self, path: &Path) -> io::Result<HdfsWriter> {
        let p = self.root.check(path)?;
        let w = self.call("create", &p, |c, p| async move {
            let opts = WriteOptions::default()
                .overwrite(true)
                .create_parent(true)
                .permission(0o644);
            c.create(&p, opts).await
        })?;
        Ok(HdfsWriter {
            store: self.clone(),
            path: p,
            writer: Some(w),
        })
    }

    /// Deletes the file at `path` (not a directory's contents):
    /// `Ok(false)` when there was none.
    ///
    /// # Errors
    /// The NameNode's error, naming the path and root.
    pub fn remove_file(&self, path: &Path) -> io::Result<bool> {
        let p = self.root.check(path)?;
        self.call(
            "delete",
            &p,
            |c, p| async move { c.delete(&p, false).await },
        )
    }

    /// Gives this store's sink hot-file hints: the files `hot` matches get
    /// its factor before each publish (see [`HotFiles`]).
    pub fn with_hot(mut self, hot: Option<HotFiles>) -> Hdfs {
        self.hot = hot;
        self
    }

    /// Files a publish assembles and reads back at once (at least 1;
    /// default [`remote::PUBLISH_THREADS`]): for the benchmark, which
    /// compares it with one at a time.
    pub fn with_publish_threads(mut self, n: usize) -> Hdfs {
        self.publish_threads = n.max(1);
        self
    }

    /// With `on`, each version is published into its own directory (the
    /// version directory the sink names, `<root>/.ferry/versions/<id>`)
    /// by one rename, markers last, and the published path becomes a
    /// pointer file `<path>.ferry-version` holding that directory's path,
    /// replaced by one rename: an older version stays whole where it is
    /// (a reader lease's URL) until it is withdrawn, and no publish moves
    /// a replica aside. Readers find a replica through resolve (its URL
    /// is the version directory) or a mount table fed from it; nothing is
    /// at the published path itself. Off (the default): replicas are
    /// published in place.
    pub fn with_versions(mut self, on: bool) -> Hdfs {
        self.versions = on;
        self
    }

    /// The version directory the published path `l` (a store path) names
    /// through its pointer file `<l>.ferry-version`; `None` without one.
    fn pointed(&self, l: &str) -> io::Result<Option<String>> {
        let bad = |why: String| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}{l}.ferry-version: {why}", self.root.url),
            )
        };
        match self.read_whole(&format!("{l}.ferry-version")) {
            Ok(b) => {
                let v =
                    String::from_utf8(b.to_vec()).map_err(|e| bad(format!("not a path: {e}")))?;
                // Only a path under the root, apart from `l`: a pointer
                // changed by hand must not send reads, renames or
                // deletions anywhere else.
                self.root
                    .check(Path::new(&v))
                    .and_then(|v| self.root.check_apart(&v, l).map(|()| v))
                    .map(Some)
                    .map_err(|e| bad(format!("names {v:?}: {e}")))
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Store path `p` with a published path above it (or `p` itself)
    /// replaced by the version directory its pointer file names; `p`
    /// itself where none does (or without versions).
    fn mapped(&self, p: &str) -> io::Result<String> {
        if !self.versions {
            return Ok(p.to_string());
        }
        for a in Path::new(p).ancestors() {
            if !a.starts_with(&self.root.path) || a == self.root.path {
                break;
            }
            let a = a.to_string_lossy();
            if let Some(v) = self.pointed(&a)? {
                return Ok(format!("{v}{}", &p[a.len()..]));
            }
        }
        Ok(p.to_string())
    }

    /// Shares unchanged files of a re-save from `bytes` up by a copy
    /// (default [`SHARE_MIN`]; 0 copies every file): for tests and the
    /// benchmark.
    pub fn with_share_min(mut self, bytes: u64) -> Hdfs {
        self.share_min = bytes;
        self
    }

    /// Files whose closes a staging area runs together (at least 1, which
    /// closes each file as the next one starts; default 64): for the
    /// benchmark, which compares the two.
    pub fn with_staging_closes(mut self, n: usize) -> Hdfs {
        self.staging_closes = n.max(1);
        self
    }

    /// The replication factor of the file at `path` (under the root).
    ///
    /// # Errors
    /// The NameNode's error, naming the path and root.
    pub fn replication(&self, path: &Path) -> io::Result<u16> {
        let st = self.status(path)?;
        Ok(st.replication.unwrap_or(0) as u16)
    }

    fn set_replication(&self, p: &str, factor: u16) -> io::Result<()> {
        self.call("set_replication", p, move |c, p| async move {
            c.set_replication(&p, u32::from(factor)).await
        })
        .map(|_| ())
    }

    /// Raises the files at store paths `files` to `factor` replicas,
    /// leaving those already at or above it; `None` when none was raised.
    fn raise(&self, files: &[String], factor: u16) -> io::Result<Option<HotRaised>> {
        let mut previous = None;
        let mut n = 0u32;
        for p in files {
            let st = self.call("stat", p, |c, p| async move { c.get_file_info(&p).await })?;
            let had = st.replication.unwrap_or(0) as u16;
            if had >= factor {
                continue;
            }
            self.set_replication(p, factor)?;
            previous.get_or_insert(had);
            n += 1;
        }
        Ok(previous.map(|previous| HotRaised {
            factor,
            previous,
            files: n,
            placed: None,
        }))
    }

    /// The fewest DataNodes holding any block of the files at store paths
    /// `files`, as the NameNode's WebHDFS API at `webhdfs` reports
    /// (`GETFILEBLOCKLOCATIONS`); `None` when none of them has a block
    /// (empty files). Asks as the user `hdfs-native` writes as
    /// (`HADOOP_USER_NAME`, else the process's user), so that staged files
    /// of mode 0600 can be seen.
    ///
    /// # Errors
    /// WebHDFS unreachable or answering with an error (its `RemoteException`
    /// message), or an answer of another shape; each naming the URL.
    pub fn placed_replicas(&self, webhdfs: &str, files: &[String]) -> io::Result<Option<u16>> {
        let user = std::env::var("HADOOP_USER_NAME").ok().or_else(|| {
            nix::unistd::User::from_uid(nix::unistd::getuid())
                .ok()
                .flatten()
                .map(|u| u.name)
        });
        let mut urls = Vec::with_capacity(files.len());
        for p in files {
            let mut u = reqwest::Url::parse(webhdfs).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("webhdfs {webhdfs}: not a URL: {e}"),
                )
            })?;
            u.path_segments_mut()
                .map_err(|()| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("webhdfs {webhdfs}: not an http:// URL"),
                    )
                })?
                .pop_if_empty()
                .extend(["webhdfs", "v1"])
                .extend(p.split('/').filter(|s| !s.is_empty()));
            u.query_pairs_mut()
                .append_pair("op", "GETFILEBLOCKLOCATIONS");
            if let Some(user) = &user {
                u.query_pairs_mut().append_pair("user.name", user);
            }
            urls.push(u);
        }
        let what = format!("webhdfs {webhdfs}");
        let lowest = block_on(&what, async move {
            let http = reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(10))
                .build()
                .map_err(|e| io::Error::other(e.to_string()))?;
            let mut lowest: Option<u16> = None;
            for u in urls {
                let shown = format!("{}{}", u.origin().ascii_serialization(), u.path());
                let r = http
                    .get(u)
                    .send()
                    .await
                    .map_err(|e| io::Error::other(format!("{shown}: {e}")))?;
                let status = r.status();
                let body: serde_json::Value = r.json().await.map_err(|e| {
                    io::Error::other(format!("{shown}: {status}, not a WebHDFS answer: {e}"))
                })?;
                if !status.is_success() {
                    let msg = body["RemoteException"]["message"]
                        .as_str()
                        .unwrap_or("no message");
                    return Err(io::Error::other(format!("{shown}: {status}: {msg}")));
                }
                let blocks = body["BlockLocations"]["BlockLocation"]
                    .as_array()
                    .ok_or_else(|| {
                        io::Error::other(format!("{shown}: no BlockLocations in the answer"))
                    })?;
                for b in blocks {
                    let n = b["names"].as_array().map_or(0, Vec::len);
                    let n = u16::try_from(n).unwrap_or(u16::MAX);
                    lowest = Some(lowest.map_or(n, |l| l.min(n)));
                }
            }
            Ok(lowest)
        })?;
        Ok(lowest)
    }

    /// Waits up to `wait` for every block of `files` to be on `factor`
    /// DataNodes ([`Hdfs::placed_replicas`], every 500 ms); returns the
    /// fewest seen last (`None`: the files have no blocks).
    ///
    /// # Errors
    /// As [`Hdfs::placed_replicas`].
    pub fn wait_placed(
        &self,
        webhdfs: &str,
        files: &[String],
        factor: u16,
        wait: std::time::Duration,
    ) -> io::Result<Option<u16>> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            let seen = self.placed_replicas(webhdfs, files)?;
            if seen.is_none_or(|n| n >= factor) || std::time::Instant::now() >= deadline {
                return Ok(seen);
            }
            std::thread::sleep(
                std::time::Duration::from_millis(500)
                    .min(deadline.saturating_duration_since(std::time::Instant::now())),
            );
        }
    }

    /// Bytes this store has copied to share unchanged files of a re-save
    /// with the published version ([`SinkStore::share_unchanged`]; HDFS
    /// has no hard links and `hdfs-native` no server-side copy, so each
    /// is read and written once more through this client).
    pub fn copied_bytes(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }

    /// Bytes the publishes of this store have rewritten: staged data read
    /// back and written once more because its chunks did not arrive in
    /// order (a file staged in order is moved by a rename instead). The
    /// extra I/O of HDFS staging is twice this.
    pub fn rewritten_bytes(&self) -> u64 {
        self.rewritten.load(Ordering::Relaxed)
    }

    /// Assembles (and with `want`, reads back) every file of `m` from
    /// staging area `staging` into `out` (markers into `held/<i>`),
    /// [`Hdfs::with_publish_threads`] files at once. Returns the chunks to
    /// fetch again (unordered) and the hot files' new paths.
    ///
    /// # Errors
    /// The first file's error (the others stop at their next file).
    fn assemble_all(
        &self,
        staging: &str,
        m: &Manifest,
        want: Option<&[(u64, Hash)]>,
        out: &str,
        held: &str,
    ) -> io::Result<(Vec<u64>, Vec<String>)> {
        let firsts = remote::first_chunks(m);
        let found = Mutex::new((Vec::new(), Vec::new()));
        remote::for_each_parallel(self.publish_threads, m.files.len(), |fi| {
            let f = &m.files[fi];
            let dst = match m.markers.iter().position(|&x| x as usize == fi) {
                Some(i) => format!("{held}/{i}"),
                None => format!("{out}/{}", f.path),
            };
            let mut refetch = Vec::new();
            self.assemble(
                staging,
                f,
                m.chunk_size,
                firsts[fi],
                want,
                &dst,
                &mut refetch,
            )?;
            let mut found = found.lock().unwrap_or_else(|p| p.into_inner());
            found.0.extend(refetch);
            if self.hot.as_ref().is_some_and(|h| h.matches(&f.path)) {
                found.1.push(dst);
            }
            Ok(())
        })?;
        Ok(found.into_inner().unwrap_or_else(|p| p.into_inner()))
    }

    /// Puts file `f` at `dst` from staging `staging`: the part written in
    /// order, then the chunks staged on their own. Each chunk is checked
    /// against `want` (from manifest chunk `first_chunk` on) where given;
    /// keys that do not match go to `refetch` and nothing is written for
    /// the file. A file staged whole in order is renamed, not rewritten.
    #[allow(clippy::too_many_arguments)]
    fn assemble(
        &self,
        staging: &str,
        f: &ferry_proto::manifest::FileEntry,
        chunk_size: u32,
        first_chunk: usize,
        want: Option<&[(u64, Hash)]>,
        dst: &str,
        refetch: &mut Vec<u64>,
    ) -> io::Result<()> {
        let n = chunk_count(f.size, chunk_size);
        let whole = in_order_key(staging, &f.path);
        let reader = match self.call("open", &whole, |c, p| async move { c.read(&p).await }) {
            Ok(r) => Some(Arc::new(r)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        let in_order = reader.as_ref().map_or(0, |r| r.file_length() as u64);
        // Chunks staged on their own take precedence over the in-order
        // file: a chunk fetched again after a failed check lands there.
        let own = format!("{staging}/{}/{}", remote::CHUNKS_DIR, f.path);
        let own: std::collections::HashSet<u64> = match self.call("list", &own, |c, p| async move {
            c.list_status(&p, false).await
        }) {
            Ok(l) => l
                .iter()
                .filter_map(|st| remote::chunk_offset(st.path.rsplit('/').next()?))
                .collect(),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Default::default(),
            Err(e) => return Err(e),
        };
        let whole_in_order = own.is_empty() && in_order == f.size && reader.is_some();
        let mut data = Vec::new();
        let mut ok = true;
        for ci in 0..n {
            let off = ci * u64::from(chunk_size);
            let len = chunk_len(f.size, chunk_size, ci);
            let bytes = match &reader {
                Some(r) if off + len <= in_order && !own.contains(&off) => {
                    if want.is_none() && whole_in_order {
                        // Staged whole, in order, nothing to check: no
                        // need to read it here.
                        Bytes::new()
                    } else {
                        let r = r.clone();
                        self.call("read", &whole, move |_, _| async move {
                            r.read_range(off as usize, len as usize).await
                        })?
                    }
                }
                _ => {
                    let key = chunk_key(staging, &f.path, off);
                    match self.read_whole(&key) {
                        Ok(b) => b,
                        Err(e) if e.kind() == io::ErrorKind::NotFound && want.is_some() => {
                            Bytes::new()
                        }
                        Err(e) => return Err(e),
                    }
                }
            };
            if let Some(w) = want {
                let (k, h) = w[first_chunk + ci as usize];
                if bytes.len() as u64 != len || *blake3::hash(&bytes).as_bytes() != h {
                    refetch.push(k);
                    ok = false;
                    continue;
                }
            } else if bytes.len() as u64 != len && !whole_in_order {
                return Err(io::Error::other(format!(
                    "{} {}: chunk at {off}: staged {} bytes, the manifest says {len}",
                    self.root.url,
                    f.path,
                    bytes.len()
                )));
            }
            if !whole_in_order {
                data.extend_from_slice(&bytes);
            }
        }
        if !ok {
            return Ok(());
        }
        if whole_in_order {
            self.rename(&whole, dst)?;
            let mode = f.mode & 0o777;
            self.call("set_permission", dst, move |c, p| async move {
                c.set_permission(&p, mode).await
            })?;
        } else {
            self.rewritten.fetch_add(f.size, Ordering::Relaxed);
            self.write_whole(dst, Bytes::from(data), f.mode)?;
        }
        let ms = (f.mtime_ns.max(0) / 1_000_000) as u64;
        self.call("set_times", dst, move |c, p| async move {
            c.set_times(&p, ms, ms).await
        })
    }

    /// Renames the markers held in staging `s` into directory `dir`, in
    /// order (a marker there already is replaced); those moved already
    /// are skipped.
    fn markers_in(&self, s: &str, dir: &str, m: &Manifest) -> io::Result<()> {
        for (i, &fi) in m.markers.iter().enumerate() {
            let held = format!("{s}/.ferry-markers/{i}");
            if self.exists_at(&held)? {
                let dst = format!("{dir}/{}", m.files[fi as usize].path);
                if self.exists_at(&dst)? {
                    self.delete_tree(&dst)?;
                }
                self.rename(&held, &dst)?;
            }
        }
        Ok(())
    }

    /// Makes published path `l` name version directory `v`: its pointer
    /// file `<l>.ferry-version` replaced by one rename (a reader sees the
    /// old pointer or the new one).
    fn point(&self, l: &str, v: &str) -> io::Result<()> {
        let (parent, name) = l.rsplit_once('/').unwrap_or(("", l));
        let tmp = format!("{parent}/.{name}.ferry-version.tmp");
        self.write_whole(&tmp, Bytes::from(v.to_string().into_bytes()), 0o644)?;
        let pointer = format!("{l}.ferry-version");
        self.call("rename", &tmp, move |c, from| async move {
            c.rename(&from, &pointer, true).await
        })
    }

    /// The moves of a publish, from `.ferry-placed` on; safe to run again
    /// after a crash at any point. With versions, into version directory
    /// `v`, then the switch of `l`'s pointer file.
    fn place(&self, s: &str, l: &str, v: &str, m: &Manifest) -> io::Result<()> {
        let out = format!("{s}/.ferry-out");
        let old = format!("{s}/.ferry-old");
        if self.versions {
            if self.exists_at(&out)? {
                self.rename(&out, v)?;
            }
            self.markers_in(s, v, m)?;
            self.point(l, v)?;
            fault_point("switched");
            // A replica published in place before versions goes (readers of
            // the published path itself see it whole until then).
            if self.exists_at(l)? {
                self.rename(l, &old)?;
            }
            if self.exists_at(&old)? {
                self.delete_tree(&old)?;
            }
            return Ok(());
        }
        if self.exists_at(&out)? {
            if self.exists_at(l)? && !self.exists_at(&old)? {
                self.rename(l, &old)?;
            }
            self.rename(&out, l)?;
            fault_point("switched");
        }
        self.markers_in(s, l, m)?;
        if self.exists_at(&old)? {
            self.delete_tree(&old)?;
        }
        Ok(())
    }
}

/// An open HDFS file.
struct HdfsFile {
    store: Hdfs,
    path: String,
    reader: Arc<hdfs_native::file::FileReader>,
}

impl RangeRead for HdfsFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let data = self.read_range(offset, buf.len() as u64)?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    fn read_range(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let size = self.reader.file_length() as u64;
        if offset.saturating_add(len) > size {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{}{}: {len} bytes at {offset}, the file has {size}",
                    self.store.root.url, self.path
                ),
            ));
        }
        let r = self.reader.clone();
        let b = self
            .store
            .call("read", &self.path, move |_, _| async move {
                r.read_range(offset as usize, len as usize).await
            })?;
        Ok(b.to_vec())
    }

    fn current(&self) -> io::Result<(u64, i64, FileVersion)> {
        self.store.stat(Path::new(&self.path))
    }
}

impl SourceStore for Hdfs {
    fn watch(&self, _root: &Path, _on_event: WatchHandler) -> io::Result<Option<Box<dyn Watch>>> {
        Ok(None)
    }

    fn list(&self, dir: &Path, markers: &[String]) -> Result<Listing, ScanError> {
        let io_err = |source| ScanError::Io {
            path: dir.to_path_buf(),
            source,
        };
        let d = self.root.check(dir).map_err(io_err)?;
        // (A published path with versions: its version's directory.)
        let d = if self.versions && !self.exists_at(&d).map_err(io_err)? {
            self.mapped(&d).map_err(io_err)?
        } else {
            d
        };
        let all = self
            .call(
                "list",
                &d,
                |c, p| async move { c.list_status(&p, true).await },
            )
            .map_err(io_err)?;
        let prefix = format!("{}/", d.trim_end_matches('/'));
        let mut files = Vec::new();
        for st in all {
            if st.isdir {
                continue;
            }
            let Some(rel) = st.path.strip_prefix(&prefix) else {
                continue;
            };
            if remote::skipped(rel) {
                continue;
            }
            files.push(Listed {
                info: FileInfo {
                    path: rel.to_string(),
                    size: st.length as u64,
                    mode: u32::from(st.permission) & 0o7777,
                    mtime_ns: ns_of_ms(st.modification_time),
                },
                version: version_of(&st),
            });
        }
        Ok(remote::order(files, markers))
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn RangeRead>> {
        let mut p = self.root.check(path)?;
        let reader = match self.call("open", &p, |c, p| async move { c.read(&p).await }) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && self.versions => {
                // A file of a published path with versions.
                p = self.mapped(&p)?;
                self.call("open", &p, |c, p| async move { c.read(&p).await })?
            }
            r => r?,
        };
        Ok(Box::new(HdfsFile {
            store: self.clone(),
            path: p,
            reader: Arc::new(reader),
        }))
    }

    fn stat(&self, path: &Path) -> io::Result<(u64, i64, FileVersion)> {
        let st = match self.status(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && self.versions => {
                let p = self.mapped(&self.root.check(path)?)?;
                self.call("stat", &p, |c, p| async move { c.get_file_info(&p).await })?
            }
            r => r?,
        };
        if st.isdir {
            return Err(io::Error::other(format!(
                "{}: a directory",
                self.root.url_of(path)
            )));
        }
        Ok((
            st.length as u64,
            ns_of_ms(st.modification_time),
            version_of(&st),
        ))
    }
}

/// A staging area on HDFS. A file whose chunks arrive in order is written
/// as one file, `<staging>/.ferry-files/<rel>`, appended to while they
/// keep coming in order; any chunk out of order is staged as its own
/// file under `.ferry-chunks/`. One writer is kept open (the file last
/// written); switching files hands it to the closes pending, and a later
/// in-order chunk of a closed file reopens it for append.
///
/// Closing a file waits for the NameNode to complete its last block, and
/// `hdfs-native` 0.14 retries that call after 500 ms when the DataNode
/// has not reported the block yet: one close after another, a batch of
/// small files took about half a second per file. So the closes of up to
/// [`PENDING_CLOSES`] files (`Hdfs::with_staging_closes`) run together, all before the staging area is
/// dropped (its chunks count as verified only after that).
struct HdfsStaging {
    store: Hdfs,
    dir: std::path::PathBuf,
    /// Bytes written in order so far, per file.
    in_order: HashMap<String, u64>,
    /// The open writer and the file it writes.
    current: Option<(String, FileWriter)>,
    /// Writers done with, not yet closed: (file, writer).
    closing: Vec<(String, FileWriter)>,
}

/// Bytes read and written at a time when an unchanged file is copied
/// into staging (8 MiB).
const COPY_PIECE: usize = 8 << 20;

/// Smallest unchanged file (bytes) a re-save copies inside the cluster
/// rather than sending it over the WAN again: 64 MiB. A copy's close waits
/// for the NameNode (often 500 ms with `hdfs-native` 0.14), so on this
/// machine's loopback cluster 434 files of 100 MB in all took 25 s to copy
/// (8 at once), against 0.8 s at 1 Gbit/s, while 1.2 GB in 6 files copied
/// at 211 MB/s (`ops/bench/publish`, RESULTS.md).
pub const SHARE_MIN: u64 = 64 << 20;

/// Finished files whose closes run together: an HDFS staging area's (see
/// [`HdfsStaging`]) and `ferry gen --out hdfs://`'s by default.
pub const PENDING_CLOSES: usize = 64;

impl HdfsStaging {
    /// Hands the open writer to the closes pending, running them when
    /// [`PENDING_CLOSES`] wait.
    fn retire_current(&mut self) -> io::Result<()> {
        if let Some(c) = self.current.take() {
            self.closing.push(c);
        }
        if self.closing.len() >= self.store.staging_closes {
            self.close_all()?;
        }
        Ok(())
    }

    /// Closes the open writer and every pending one, all at once; the
    /// first error names its file.
    fn close_all(&mut self) -> io::Result<()> {
        let mut all = std::mem::take(&mut self.closing);
        all.extend(self.current.take());
        close_together(&self.store, all)
    }
}

/// Closes every writer of `all` (file name, writer) at once, so that the
/// NameNode's waits for their last blocks overlap; the first error names
/// its file.
fn close_together(store: &Hdfs, all: Vec<(String, FileWriter)>) -> io::Result<()> {
    if all.is_empty() {
        return Ok(());
    }
    let what = format!("{} close", store.root.url);
    block_on(&what, async move {
        let closes = all.into_iter().map(|(rel, mut w)| async move {
            Box::pin(w.close()).await.map_err(|e| {
                let e = io_of(e);
                io::Error::new(e.kind(), format!("{rel}: {e}"))
            })
        });
        futures::future::join_all(closes)
            .await
            .into_iter()
            .collect::<io::Result<Vec<()>>>()
            .map(|_| ())
    })
}

impl Drop for HdfsStaging {
    fn drop(&mut self) {
        // Callers of the seams run on threads that may block.
        if let Err(e) = self.close_all() {
            tracing::warn!(error = %e, "closing staged HDFS files");
        }
    }
}

impl Staging for HdfsStaging {
    fn finish(&mut self) -> io::Result<()> {
        self.close_all()
    }

    fn stage_chunk(&mut self, rel: &str, offset: u64, bytes: &[u8]) -> io::Result<()> {
        ferry_proto::paths::check_relative(rel)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{rel}: {e}")))?;
        let s = self.store.root.check(&self.dir)?;
        let own_file = |store: &Hdfs| {
            store.write_whole(
                &chunk_key(&s, rel, offset),
                Bytes::copy_from_slice(bytes),
                0o600,
            )
        };
        let done = self.in_order.get(rel).copied().unwrap_or(0);
        if offset != done {
            // Out of order: its own file, assembled at publish.
            return own_file(&self.store);
        }
        let data = Bytes::copy_from_slice(bytes);
        let path = in_order_key(&s, rel);
        let w = match self.current.take() {
            Some((r, w)) if r == rel => w,
            other => {
                self.current = other;
                self.retire_current()?;
                if self.closing.iter().any(|(r, _)| r == rel) {
                    // Its writer holds the file's lease until it closes.
                    self.close_all()?;
                }
                let opened = self.store.call("open", &path, move |c, p| async move {
                    if offset == 0 {
                        // Never over another writer's file (a chunk sent
                        // again, another stream's staging): created once.
                        let opts = WriteOptions::default()
                            .overwrite(false)
                            .create_parent(true)
                            .permission(0o600);
                        c.create(&p, opts).await
                    } else {
                        c.append(&p).await
                    }
                });
                match opened {
                    Ok(w) => w,
                    Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                        self.in_order.insert(rel.to_string(), u64::MAX);
                        return own_file(&self.store);
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let mut w = w;
        match self.store.call("write", &path, move |_, _| async move {
            Box::pin(w.write_bytes(data)).await.map(|_| w)
        }) {
            Ok(w) => {
                self.current = Some((rel.to_string(), w));
                self.in_order
                    .insert(rel.to_string(), offset + bytes.len() as u64);
                Ok(())
            }
            Err(e) => {
                // What was written in order stays, up to what HDFS kept;
                // the publish reads back what is there.
                self.in_order.remove(rel);
                Err(e)
            }
        }
    }
}

/// A file being written in order on HDFS ([`Hdfs::create_file`]). It is
/// complete once [`HdfsWriter::close`] returns; dropped unclosed, it is
/// closed with what was written (the partial file a killed writer leaves
/// once its lease is recovered), and a failure to do so is logged.
pub struct HdfsWriter {
    store: Hdfs,
    path: String,
    writer: Option<FileWriter>,
}

impl fmt::Debug for HdfsWriter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HdfsWriter({}{})", self.store.root.url, self.path)
    }
}

impl HdfsWriter {
    fn closed(&self) -> io::Error {
        io::Error::other(format!(
            "{} write {}: the writer failed before",
            self.store.root.url, self.path
        ))
    }

    /// Appends `bytes` (the writer keeps no copy once this returns).
    ///
    /// # Errors
    /// The DataNode's or NameNode's error, naming the path and root; the
    /// writer is unusable afterwards.
    pub fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mut w = self.writer.take().ok_or_else(|| self.closed())?;
        let data = Bytes::copy_from_slice(bytes);
        let w = self
            .store
            .call("write", &self.path, move |_, _| async move {
                Box::pin(w.write_bytes(data)).await.map(|_| w)
            })?;
        self.writer = Some(w);
        Ok(())
    }

    /// Closes the file: its length is final and readers see every byte.
    ///
    /// # Errors
    /// The NameNode's error (the last block not completed), naming the
    /// path and root.
    pub fn close(mut self) -> io::Result<()> {
        self.close_now()
    }

    /// Closes every writer of `all` (all of one store) at once: the
    /// NameNode's waits for their last blocks overlap (`hdfs-native` 0.14
    /// retries a close after 500 ms when the DataNode has not reported
    /// the block yet). Every file is complete when this returns `Ok`.
    ///
    /// # Errors
    /// The first NameNode error, naming its file; the others are closed
    /// still.
    pub fn close_together(all: Vec<HdfsWriter>) -> io::Result<()> {
        let Some(store) = all.first().map(|w| w.store.clone()) else {
            return Ok(());
        };
        let together = all
            .into_iter()
            .filter_map(|mut w| Some((w.path.clone(), w.writer.take()?)))
            .collect();
        close_together(&store, together)
    }

    fn close_now(&mut self) -> io::Result<()> {
        match self.writer.take() {
            Some(mut w) => self
                .store
                .call("close", &self.path, move |_, _| async move {
                    Box::pin(w.close()).await
                }),
            None => Ok(()),
        }
    }
}

impl Drop for HdfsWriter {
    fn drop(&mut self) {
        if let Err(e) = self.close_now() {
            tracing::warn!(error = %e, "closing an HDFS file");
        }
    }
}

/// The file of `rel` written in order in staging area `staging`.
fn in_order_key(staging: &str, rel: &str) -> String {
    format!("{staging}/.ferry-files/{rel}")
}

impl SinkStore for Hdfs {
    fn staging(&self, dir: &Path) -> Box<dyn Staging> {
        Box::new(HdfsStaging {
            store: self.clone(),
            dir: dir.to_path_buf(),
            in_order: HashMap::new(),
            current: None,
            closing: Vec::new(),
        })
    }

    fn share_unchanged(&self, previous: &Path, staging: &Path, rel: &str) -> io::Result<()> {
        ferry_proto::paths::check_relative(rel)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{rel}: {e}")))?;
        // No hard links and no server-side copy: the published file is
        // read and written into staging as the file's in-order copy,
        // which the publish then moves by a rename (and reads back).
        let from = format!("{}/{rel}", self.mapped(&self.root.check(previous)?)?);
        let to = in_order_key(&self.root.check(staging)?, rel);
        let size = self
            .call(
                "stat",
                &from,
                |c, p| async move { c.get_file_info(&p).await },
            )?
            .length as u64;
        if size < self.share_min {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!(
                    "{}{from}: {size} bytes, under {} to copy: sent again",
                    self.root.url, self.share_min
                ),
            ));
        }
        let copied = self.call("copy", &from, move |c, from| async move {
            let r = c.read(&from).await?;
            let size = r.file_length();
            let opts = WriteOptions::default()
                .overwrite(true)
                .create_parent(true)
                .permission(0o600);
            let mut w = c.create(&to, opts).await?;
            let mut off = 0usize;
            while off < size {
                let n = COPY_PIECE.min(size - off);
                let piece = r.read_range(off, n).await?;
                Box::pin(w.write_bytes(piece)).await?;
                off += n;
            }
            Box::pin(w.close()).await?;
            Ok(size as u64)
        })?;
        self.copied.fetch_add(copied, Ordering::Relaxed);
        Ok(())
    }

    fn publish(
        &self,
        staging: &Path,
        local_path: &Path,
        version: &Path,
        m: &Manifest,
        reread: Option<&[(u64, Hash)]>,
        readers: Option<u64>,
    ) -> io::Result<PublishOutcome> {
        let s = self.root.check(staging)?;
        let l = self.root.check(local_path)?;
        let v = self.root.check(version)?;
        if self.versions {
            self.root.check_apart(&v, &l)?;
        }
        let placed = format!("{s}/.ferry-placed");
        if self.exists_at(&placed)? {
            self.place(&s, &l, &v, m)?;
            return Ok(PublishOutcome::Recovered);
        }
        let out = format!("{s}/.ferry-out");
        let held = format!("{s}/.ferry-markers");
        for d in [&out, &held] {
            if self.exists_at(d)? {
                self.delete_tree(d)?;
            }
        }
        let start = std::time::Instant::now();
        let (mut refetch, hot) = self.assemble_all(&s, m, reread, &out, &held)?;
        refetch.sort_unstable();
        if !refetch.is_empty() {
            self.delete_tree(&out)?;
            self.delete_tree(&held)?;
            return Ok(PublishOutcome::Refetch(refetch));
        }
        let reread_time = reread.map(|_| start.elapsed());
        // Hot files get their higher replication in staging, before the
        // rename makes them readable.
        let hot = match &self.hot {
            Some(h) => {
                let mut raised = self.raise(&hot, h.factor_for_readers(readers))?;
                if let (Some(r), Some((webhdfs, wait))) = (raised.as_mut(), &h.placement) {
                    r.placed = match self.wait_placed(webhdfs, &hot, r.factor, *wait) {
                        Ok(n) => n,
                        Err(e) => {
                            tracing::warn!(error = %e, "could not see where HDFS placed the hot files' replicas; publishing without waiting");
                            None
                        }
                    };
                }
                raised
            }
            None => None,
        };
        // A checkpoint of markers only still publishes a directory.
        self.call("mkdirs", &out, |c, p| async move {
            c.mkdirs(&p, 0o755, true).await
        })?;
        self.write_whole(&placed, Bytes::from(l.clone().into_bytes()), 0o600)?;
        fault_point("placed");
        self.place(&s, &l, &v, m)?;
        Ok(PublishOutcome::Published {
            reread: reread_time.map(ReadBack::wall_only),
            hot,
        })
    }

    fn lower_hot(&self, replica: &Path, m: &Manifest, factor: u16) -> io::Result<u32> {
        let Some(h) = &self.hot else {
            return Ok(0);
        };
        let l = self.mapped(&self.root.check(replica)?)?;
        let mut n = 0;
        for f in m.files.iter().filter(|f| h.matches(&f.path)) {
            match self.set_replication(&format!("{l}/{}", f.path), factor) {
                Ok(()) => n += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(n)
    }

    fn publish_under_way(&self, staging: &Path) -> bool {
        self.root
            .check(staging)
            .and_then(|s| self.exists_at(&format!("{s}/.ferry-placed")))
            .unwrap_or(false)
    }

    fn publish_recorded(&self, staging: &Path) -> io::Result<()> {
        self.discard(staging)
    }

    fn discard(&self, staging: &Path) -> io::Result<()> {
        let s = self.root.check(staging)?;
        self.delete_tree(&s)
    }

    fn withdraw(
        &self,
        local_path: &Path,
        version: &Path,
        aside: &Path,
        _keep: &[PathBuf],
    ) -> io::Result<bool> {
        let l = self.root.check(local_path)?;
        let a = self.root.check(aside)?;
        if self.versions {
            let v = self.root.check(version)?;
            let mut moved = false;
            if self.pointed(&l)?.as_deref() == Some(v.as_str()) {
                // Out of the published namespace in one step.
                let pointer = format!("{l}.ferry-version");
                self.call("delete", &pointer, |c, p| async move {
                    c.delete(&p, false).await
                })?;
                moved = true;
            }
            if self.exists_at(&v)? {
                self.rename(&v, &a)?;
                moved = true;
            } else if !moved && self.pointed(&l)?.is_none() && self.exists_at(&l)? {
                // Published in place before versions.
                self.rename(&l, &a)?;
                moved = true;
            }
            return Ok(moved);
        }
        if !self.exists_at(&l)? {
            return Ok(false);
        }
        // One directory rename: a reader sees the whole version or nothing.
        self.rename(&l, &a)?;
        Ok(true)
    }

    fn retire(&self, aside: &Path) -> io::Result<()> {
        let a = self.root.check(aside)?;
        match self.delete_tree(&a) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    fn free_space(&self, _path: &Path) -> io::Result<Option<u64>> {
        let r = self.root.path.to_string_lossy().into_owned();
        let sum = self.call("content summary", &r, |c, p| async move {
            c.get_content_summary(&p).await
        })?;
        Ok(match self.capacity {
            Some(cap) => Some(cap.saturating_sub(sum.length)),
            // Hadoop reports -1 (as u64: all ones) or 0 for no quota.
            None if sum.space_quota != 0 && sum.space_quota != u64::MAX => {
                Some(sum.space_quota.saturating_sub(sum.space_consumed))
            }
            None => None,
        })
    }

    fn flush(&self, _dir: &Path) -> io::Result<()> {
        // Every staged chunk is closed (acknowledged by the DataNode
        // pipeline) before stage_chunk returns.
        Ok(())
    }

    fn capacity(&self, _path: &Path) -> io::Result<Option<u64>> {
        if self.capacity.is_some() {
            return Ok(self.capacity);
        }
        let r = self.root.path.to_string_lossy().into_owned();
        let sum = self.call("content summary", &r, |c, p| async move {
            c.get_content_summary(&p).await
        })?;
        // Hadoop reports -1 (as u64: all ones) or 0 for no quota.
        Ok((sum.space_quota != 0 && sum.space_quota != u64::MAX).then_some(sum.space_quota))
    }

    fn exists(&self, path: &Path) -> io::Result<bool> {
        let p = self.root.check(path)?;
        Ok(self.exists_at(&p)? || (self.versions && self.exists_at(&self.mapped(&p)?)?))
    }

    fn versioned(&self) -> bool {
        self.versions
    }

    fn adopt(&self, local_path: &Path, version: &Path) -> io::Result<bool> {
        if !self.versions {
            return Ok(false);
        }
        let l = self.root.check(local_path)?;
        let v = self.root.check(version)?;
        if self.pointed(&l)?.is_some() {
            return Ok(false);
        }
        let in_place = self.exists_at(&l)?;
        if in_place {
            if self.exists_at(&v)? {
                return Err(io::Error::other(format!(
                    "{} exists already; {} stays where it is",
                    self.root.url_of(version),
                    self.root.url_of(local_path)
                )));
            }
            // One directory rename, then the pointer (a crash between is
            // finished at the next start: the directory is then at `v`).
            self.rename(&l, &v)?;
        } else if !self.exists_at(&v)? {
            return Ok(false);
        }
        self.point(&l, &v)?;
        Ok(true)
    }

    fn named_version(&self, local_path: &Path) -> io::Result<Option<PathBuf>> {
        if !self.versions {
            return Ok(None);
        }
        Ok(self
            .pointed(&self.root.check(local_path)?)?
            .map(PathBuf::from))
    }

    fn list_names(&self, dir: &Path) -> io::Result<Vec<String>> {
        let d = self.root.check(dir)?;
        match self.call(
            "list",
            &d,
            |c, p| async move { c.list_status(&p, false).await },
        ) {
            Ok(entries) => Ok(entries
                .into_iter()
                .filter_map(|e| e.path.rsplit('/').next().map(str::to_string))
                .collect()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }

    fn located_url(&self, path: &Path) -> io::Result<Option<String>> {
        let p = self.root.check(path)?;
        Ok(Some(self.root.url_of(Path::new(&self.mapped(&p)?))))
    }

    fn replica_url(&self, local_path: &Path, version: &Path) -> Option<String> {
        Some(
            self.root
                .url_of(if self.versions { version } else { local_path }),
        )
    }

    fn read_small(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        let p = self.root.check(path)?;
        match self.call("stat", &p, |c, p| async move { c.get_file_info(&p).await }) {
            Ok(st) if st.isdir => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: not a regular file", self.root.url_of(path)),
            )),
            Ok(_) => self.read_whole(&p).map(|b| Some(b.to_vec())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn replace_small(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let p = self.root.check(path)?;
        let (parent, name) = p.rsplit_once('/').unwrap_or(("", &p));
        let tmp = format!("{parent}/.{name}.ferry-tmp");
        self.write_whole(&tmp, Bytes::copy_from_slice(bytes), 0o644)?;
        // One rename over the old file: a reader sees the old bytes or
        // the new ones.
        self.call("rename", &tmp, move |c, from| async move {
            c.rename(&from, &p, true).await
        })
    }

    fn url_of(&self, path: &Path) -> Option<String> {
        Some(self.root.url_of(path))
    }
}
