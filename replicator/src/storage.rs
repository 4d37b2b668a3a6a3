//! Storage seams: what the source and the sink ask of the storage that
//! holds checkpoints, at the level they think in (a tree of files to
//! list and read; chunks to stage, a staging area to publish, versions to
//! retire), not POSIX calls. A backend implements [`SourceStore`] and
//! [`SinkStore`]; [`posix`] is the one of this build: today's local file
//! systems (pwrite, hard links, rename and `RENAME_EXCHANGE`, syncfs).
//!
//! The seams leave room for stores that cannot do what POSIX does:
//! HDFS files are written once, by one writer, appending only, and S3
//! objects are immutable with no rename. So the sink never asks for a
//! rename or an in-place write: it stages chunks at offsets (a backend
//! without random writes buffers or assembles them), shares a file with
//! the previous version when it can ([`SinkStore::share_unchanged`] may
//! decline), and publishes a staging area as a whole
//! ([`SinkStore::publish`] answers where the replica is). Change detection
//! at the source uses an opaque [`FileVersion`] per file, not the mtime
//! alone.
//!
//! Calls block; async callers run them on the blocking pool.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferry_proto::manifest::{chunk_count, chunk_len, FileEntry, FileInfo, Hash, Manifest};

pub mod hdfs;
pub mod posix;
pub mod remote;
pub mod router;
pub mod s3;

/// An opaque per-file version token: two listings of a file with equal
/// tokens saw the same content. On POSIX it covers the inode, size, mtime
/// and ctime (a rewrite in place changes the ctime even when it restores
/// the size and mtime); other backends use what they have (an HDFS file
/// id and length, an S3 ETag).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FileVersion(pub [u64; 4]);

impl FileVersion {
    /// A version from one raw value (a backend's own change counter, say).
    pub const fn from_raw(raw: u64) -> FileVersion {
        FileVersion([raw, 0, 0, 0])
    }
}

/// One file of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Path relative to the listed directory, size (bytes), mode, mtime.
    pub info: FileInfo,
    /// Its version token.
    pub version: FileVersion,
}

/// What a checkpoint's transfer should contain, as [`SourceStore::list`]
/// finds it.
#[derive(Debug, Clone)]
pub struct Listing {
    /// Files in transfer order: non-markers sorted by path, then markers.
    pub files: Vec<Listed>,
    /// Indices of markers in `files`, in publish order.
    pub markers: Vec<u32>,
}

/// A [`Listing`] without version tokens: what a transfer sends.
#[derive(Debug, Clone)]
pub struct Infos {
    /// Files in transfer order: non-markers sorted by path, then markers.
    pub files: Vec<FileInfo>,
    /// Indices of markers in `files`, in publish order.
    pub markers: Vec<u32>,
}

impl Listing {
    /// The files without their version tokens (no copy of the entries).
    pub fn into_infos(self) -> Infos {
        Infos {
            files: self.files.into_iter().map(|f| f.info).collect(),
            markers: self.markers,
        }
    }
}

/// Reads byte ranges of one file.
pub trait RangeRead: Send {
    /// Fills `buf` from byte `offset`.
    ///
    /// # Errors
    /// I/O errors; `UnexpectedEof` when the file ends first.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;

    /// Reads `len` bytes from `offset` into a new buffer (no zero fill of
    /// a buffer that is about to be overwritten).
    ///
    /// # Errors
    /// As [`RangeRead::read_exact_at`].
    fn read_range(&self, offset: u64, len: u64) -> io::Result<Vec<u8>>;

    /// [`RangeRead::read_range`] into `buf`, replacing its contents and
    /// using its capacity (a buffer from a [`crate::bufpool::BufPool`]);
    /// a backend without a cheaper way replaces `buf` with a new buffer.
    ///
    /// # Errors
    /// As [`RangeRead::read_exact_at`].
    fn read_range_into(&self, offset: u64, len: u64, buf: &mut Vec<u8>) -> io::Result<()> {
        *buf = self.read_range(offset, len)?;
        Ok(())
    }

    /// The file's size (bytes), mtime (ns since the Unix epoch) and version
    /// now, to tell whether it changed while it was read.
    ///
    /// # Errors
    /// I/O errors.
    fn current(&self) -> io::Result<(u64, i64, FileVersion)>;
}

/// A change a store saw under a watched root ([`SourceStore::watch`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// Something happened to these paths (created, written, removed,
    /// renamed): worth a look at the next scan.
    Touched(Vec<PathBuf>),
    /// The file at this path was closed after being written.
    ClosedAfterWrite(PathBuf),
    /// A file was renamed from `from` to `to`.
    Renamed {
        /// Its old path.
        from: PathBuf,
        /// Its new path.
        to: PathBuf,
    },
    /// Events were lost (a queue overflowed): scan everything.
    Overflow,
}

/// A watch in progress; dropping it stops the watch.
pub trait Watch: Send {}

/// Receives the events of a watch, on a thread of the store's.
pub type WatchHandler = Box<dyn Fn(WatchEvent) + Send + Sync>;

/// Where a source reads checkpoints.
pub trait SourceStore: Send + Sync + fmt::Debug {
    /// Watches the tree under `root` where the backend can (inotify on
    /// POSIX), calling `on_event` for each change until the returned watch
    /// is dropped; `Ok(None)` when the backend has no way to watch (the
    /// caller rescans on a timer).
    ///
    /// # Errors
    /// Why the watch could not start (the caller falls back to rescans).
    fn watch(&self, root: &Path, on_event: WatchHandler) -> io::Result<Option<Box<dyn Watch>>>;

    /// Lists the regular files under `dir` (recursively, temporaries
    /// skipped) with sizes, modes, mtimes and version tokens; files whose
    /// names are in `markers` go last, in that order.
    ///
    /// # Errors
    /// [`ScanError`] naming the path that could not
    /// be read, or something in the tree that cannot be replicated.
    fn list(&self, dir: &Path, markers: &[String]) -> Result<Listing, ScanError>;

    /// Opens `path` for ranged reads.
    ///
    /// # Errors
    /// I/O errors (`NotFound` when it is gone).
    fn open(&self, path: &Path) -> io::Result<Box<dyn RangeRead>>;

    /// The size (bytes), mtime (ns since the Unix epoch) and version of
    /// the file at `path` now.
    ///
    /// # Errors
    /// I/O errors (`NotFound` when it is gone).
    fn stat(&self, path: &Path) -> io::Result<(u64, i64, FileVersion)>;
}

/// Stages the chunks of one transfer.
pub trait Staging: Send {
    /// Writes `bytes` at byte `offset` of file `rel` (a relative path
    /// already checked by [`ferry_proto::paths::check_relative`]) of the
    /// staging area.
    ///
    /// # Errors
    /// I/O errors naming the file; a symlink or special file in the
    /// staging area is refused, never written through.
    fn stage_chunk(&mut self, rel: &str, offset: u64, bytes: &[u8]) -> io::Result<()>;

    /// Ends what [`Staging::stage_chunk`] left under way (HDFS: the closes
    /// of the files written), so that every chunk staged so far is in
    /// the store; the caller counts them only after this. Nothing to do
    /// by default. Dropping a staging area also ends it, but can only
    /// log an error.
    ///
    /// # Errors
    /// I/O errors naming the file.
    fn finish(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What reading staging back before a publish cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReadBack {
    /// Wall time of the read-back.
    pub wall: Duration,
    /// CPU time of the read-back, summed over the threads that read and
    /// hashed (user and system time; it can exceed `wall`). Zero where
    /// the backend cannot tell (HDFS and S3 read on a runtime shared with
    /// other calls).
    pub cpu: Duration,
}

impl ReadBack {
    /// A read-back whose CPU time the backend cannot tell apart from
    /// other work (HDFS and S3 read on a runtime shared with other calls):
    /// `wall` and a `cpu` of zero.
    pub fn wall_only(wall: Duration) -> ReadBack {
        ReadBack {
            wall,
            cpu: Duration::ZERO,
        }
    }
}

/// What [`SinkStore::publish`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum PublishOutcome {
    /// The replica is in place; `reread` is what reading staging back
    /// cost, if it was read back.
    Published {
        /// The read-back before the move, if there was one.
        reread: Option<ReadBack>,
        /// The replication its hot files were given before the move
        /// (HDFS with hot-file hints); `None` elsewhere.
        hot: Option<HotRaised>,
    },
    /// The replica was already in place, from a publish a crash
    /// interrupted; it has been finished.
    Recovered,
    /// These chunk keys no longer match the manifest in staging; nothing
    /// moved. Fetch them again.
    Refetch(Vec<u64>),
}

/// What a publish did to the replication of a replica's hot files (the
/// files every eval rank reads) at an HDFS sink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HotRaised {
    /// The replication factor they were given.
    pub factor: u16,
    /// The factor they were written with, to restore when the hint ends.
    pub previous: u16,
    /// How many files were raised.
    pub files: u32,
    /// The fewest DataNodes holding any block of the hot files when the
    /// publish went ahead, where the sink waited for the placement
    /// (`[sink.hdfs] webhdfs`); `None` where it did not look.
    pub placed: Option<u16>,
}

/// Where a sink stages and publishes replicas.
pub trait SinkStore: Send + Sync + fmt::Debug {
    /// The staging area at `dir`, created on the first chunk.
    fn staging(&self, dir: &Path) -> Box<dyn Staging>;

    /// Makes file `rel` of the staging area `staging` the same file as
    /// `rel` of the published version at `previous` (unchanged between
    /// the versions), without copying where the backend can. Declining
    /// (an error) only means the file is transferred again.
    ///
    /// # Errors
    /// I/O errors, or that the backend cannot share files.
    fn share_unchanged(&self, previous: &Path, staging: &Path, rel: &str) -> io::Result<()>;

    /// Makes file `f` of staging area `from` also file `f` of staging area
    /// `to` without copying (a weights-first transfer's weights-only
    /// version, published from `to` while `from` still fills): a hard link,
    /// after giving the file `f`'s mode and modification time, which both
    /// publishes set, so that neither copies it. The two names share the
    /// bytes from then on; a later write into `from` copies first, as
    /// into any file shared with a published version.
    ///
    /// # Errors
    /// I/O errors naming the path; [`io::ErrorKind::Unsupported`] where
    /// the backend has no hard links (the default).
    fn link_staged(
        &self,
        _from: &Path,
        _to: &Path,
        _f: &ferry_proto::manifest::FileEntry,
    ) -> io::Result<()> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "this storage cannot share a file between two staging areas",
        ))
    }

    /// Publishes staging area `staging` at `local_path` as checkpoint `m`,
    /// atomically: a reader sees the previous version or the whole new
    /// one, commit markers last. Where the backend keeps versions
    /// ([`SinkStore::versioned`]), the files go to the version directory
    /// `version` (a path of the sink's own area, new) and `local_path`
    /// names it from then on; the previous version's directory stays
    /// until [`SinkStore::withdraw`] takes it. Elsewhere `version` is not
    /// used and the previous version is replaced. With `reread` (the
    /// chunk keys of `m`, one per chunk in manifest order), staging is
    /// read back and checked first. `readers`: how many readers the
    /// replica should expect, as its transfer said (an HDFS sink sizes
    /// its hot-file replication hints from it; others ignore it).
    /// Finishes a publish that a crash interrupted.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn publish(
        &self,
        staging: &Path,
        local_path: &Path,
        version: &Path,
        m: &Manifest,
        reread: Option<&[(u64, Hash)]>,
        readers: Option<u64>,
    ) -> io::Result<PublishOutcome>;

    /// Whether each published version keeps a location of its own that
    /// later publishes at the same path leave alone (POSIX: version
    /// directories behind a symbolic link; S3: version prefixes named by
    /// the published path's commit object; HDFS with versions: version
    /// directories named by a pointer file), so that a reader lease can
    /// hold one. False (the default; HDFS without versions): publishing
    /// replaces in place.
    fn versioned(&self) -> bool {
        false
    }

    /// The version directory the published path `local_path` names now;
    /// `None` when nothing is published there, or the backend does not
    /// keep versions, or `local_path` holds a replica itself (published
    /// before version directories).
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn named_version(&self, _local_path: &Path) -> io::Result<Option<PathBuf>> {
        Ok(None)
    }

    /// Moves a replica published at `local_path` itself (before version
    /// directories) into version directory `version`, leaving
    /// `local_path` naming it, without a moment where a reader of
    /// `local_path` sees anything else. False when there is nothing to
    /// move (or the backend does not keep versions).
    ///
    /// # Errors
    /// I/O errors naming the path; nothing moves then.
    fn adopt(&self, _local_path: &Path, _version: &Path) -> io::Result<bool> {
        Ok(false)
    }

    /// Whether a publish from `staging` has begun and the catalog has not
    /// yet recorded it ([`SinkStore::publish_recorded`]).
    fn publish_under_way(&self, staging: &Path) -> bool;

    /// The catalog has recorded the replica published from `staging`.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn publish_recorded(&self, staging: &Path) -> io::Result<()>;

    /// Removes a staging area and anything a publish from it left.
    ///
    /// # Errors
    /// I/O errors naming the path (`NotFound` is not an error).
    fn discard(&self, staging: &Path) -> io::Result<()>;

    /// Takes version `version` (as given to [`SinkStore::publish`]) out
    /// of the published namespace in one atomic step (a reader of
    /// `local_path` sees the whole version or nothing there), leaving a
    /// newer version published at `local_path` alone, and moves it to
    /// `aside`, a path of the sink's own area that does not exist yet;
    /// [`SinkStore::retire`] then deletes it. Where the backend does not
    /// keep versions, what is at `local_path` moves. A backend that cannot
    /// move a replica (S3) deletes it here instead, which the caller's
    /// publish lock on `local_path` keeps from touching a newer version;
    /// `aside` is then not made. `Ok(false)` when there was nothing to
    /// move (withdrawn already).
    ///
    /// `keep`: the version directories of the other versions at
    /// `local_path` that stay (the catalog's published versions there):
    /// a backend whose versions share files by reference (S3) leaves the
    /// objects those versions still name.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn withdraw(
        &self,
        local_path: &Path,
        version: &Path,
        aside: &Path,
        keep: &[PathBuf],
    ) -> io::Result<bool>;

    /// The names directly under directory `dir` (POSIX: its entries; S3:
    /// the next segment of every key under the prefix, a commit object
    /// `<name>.ferry-commit` as `name`), in no order; empty when nothing
    /// is there. Backends that keep versions implement it (the sweep of
    /// version directories lists with it); the default answers
    /// [`io::ErrorKind::Unsupported`].
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn list_names(&self, dir: &Path) -> io::Result<Vec<String>> {
        Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("{}: this storage lists no directories", dir.display()),
        ))
    }

    /// Whether versions share unchanged files by hard links (POSIX), so
    /// that space is counted by file identity and a weights-first
    /// transfer can link one staging area's files into another's
    /// ([`SinkStore::link_staged`]). False (the default) elsewhere.
    fn hard_links(&self) -> bool {
        false
    }

    /// Checks, in directory `dir` of the sink root (made if missing), that
    /// this store does what a sink pool relies on when several agents
    /// publish into one root: on POSIX, that `renameat2(RENAME_EXCHANGE)`
    /// and hard links work there (an NFS or FUSE mount may refuse either).
    /// HDFS and S3 pass: their publishes use renames and conditional
    /// creates that every server does (the conformance suite checks
    /// both).
    ///
    /// # Errors
    /// An error naming the operation that failed and the path.
    fn check_pool_ready(&self, dir: &Path) -> io::Result<()> {
        let _ = dir;
        Ok(())
    }

    /// The URL of the replica published at `local_path` as version
    /// `version`, without asking the store: [`SinkStore::url_of`] of
    /// `local_path` (the default), or of `version` where readers find each
    /// version at its own directory (HDFS with versions). `None` on a
    /// local directory.
    fn replica_url(&self, local_path: &Path, _version: &Path) -> Option<String> {
        self.url_of(local_path)
    }

    /// Where a reader finds path `path` of a published replica or version
    /// (a file or directory inside it): its URL, as [`SinkStore::url_of`]
    /// says, except on a store where a version names some files by
    /// reference (S3: a file kept from an earlier version is that
    /// version's object, found through the commit object). `None` on a
    /// local directory.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn located_url(&self, path: &Path) -> io::Result<Option<String>> {
        Ok(self.url_of(path))
    }

    /// Deletes a version [`SinkStore::withdraw`] moved to `aside`. A
    /// deletion a crash interrupted is finished by calling it again.
    ///
    /// # Errors
    /// I/O errors naming the path (`NotFound` is not an error).
    fn retire(&self, aside: &Path) -> io::Result<()>;

    /// Bytes free for new replicas under `path`; `None` when the backend
    /// cannot tell (an object store).
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn free_space(&self, path: &Path) -> io::Result<Option<u64>>;

    /// Bytes the storage under `path` holds in all, free and used (the
    /// base of `[sink] min_free = "10%"`); `None` when the backend cannot
    /// tell, the default.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn capacity(&self, _path: &Path) -> io::Result<Option<u64>> {
        Ok(None)
    }

    /// Makes what was staged under `dir` durable (a background flush as
    /// the data arrives, so little is left for the publish).
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn flush(&self, dir: &Path) -> io::Result<()>;

    /// Makes directory `dir` exist where the store has directories (POSIX:
    /// `mkdir -p`); stores that make parents as they write (HDFS) or have
    /// none (S3) do nothing, the default.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn make_dir(&self, _dir: &Path) -> io::Result<()> {
        Ok(())
    }

    /// Whether something is at `path`: a file or directory (POSIX, HDFS),
    /// an object or a published replica's prefix (S3). A published
    /// replica's files are answered by the replica's own listing, so a
    /// file the checkpoint does not hold is absent.
    ///
    /// # Errors
    /// I/O errors naming the path (absent is `Ok(false)`).
    fn exists(&self, path: &Path) -> io::Result<bool>;

    /// The bytes of the small regular file at `path` (a marker beside a
    /// replica: DeepSpeed's `latest`, Megatron's tracker), `None` when
    /// nothing is there.
    ///
    /// # Errors
    /// I/O errors naming the path; `InvalidData` when something other
    /// than a regular file is there.
    fn read_small(&self, path: &Path) -> io::Result<Option<Vec<u8>>>;

    /// Replaces the small file at `path` with `bytes`, durably and in one
    /// step where the store can (POSIX: a temporary file and a rename;
    /// S3: one PUT; HDFS: a temporary file renamed over it), never
    /// writing through a symbolic link.
    ///
    /// # Errors
    /// I/O errors naming the path.
    fn replace_small(&self, path: &Path, bytes: &[u8]) -> io::Result<()>;

    /// Sets the replication of the hot files of the replica published at
    /// `replica` (the manifest's files that the store's hot-file hints
    /// match) back to `factor`; returns how many it set. Stores without
    /// hints do nothing (`Ok(0)`), the default.
    ///
    /// # Errors
    /// Errors of the store naming the path (a file gone is skipped).
    fn lower_hot(&self, _replica: &Path, _m: &Manifest, _factor: u16) -> io::Result<u32> {
        Ok(0)
    }

    /// The URL readers use for `path` of this store
    /// (`hdfs://nn:8020/eval/job/step-100`, `s3://bucket/eval/job/step-100`);
    /// `None` for a local file system, whose paths are used as they are.
    fn url_of(&self, _path: &Path) -> Option<String> {
        None
    }
}

/// Errors while listing or reading a checkpoint at the source.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// An I/O error on a named path.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// A file changed while it was read (size or mtime differ).
    #[error("{path} changed while it was being read")]
    Changed {
        /// The path.
        path: PathBuf,
    },
    /// Something in the directory cannot be replicated.
    #[error("{path}: {why}")]
    Unsupported {
        /// The path.
        path: PathBuf,
        /// Why.
        why: String,
    },
}

/// Reads `path` once, sequentially, in `chunk_size` reads from `store`,
/// calling `on_chunk(index, bytes, hash)` for each chunk; returns the chunk
/// hashes. Checks afterwards that size and mtime still match `info`.
///
/// # Errors
/// [`ScanError::Io`] on a read error, [`ScanError::Changed`] if the file
/// is shorter than announced or its size or mtime changed, and whatever
/// `on_chunk` returns.
pub fn read_chunks(
    store: &dyn SourceStore,
    path: &Path,
    info: &FileInfo,
    chunk_size: u32,
    mut on_chunk: impl FnMut(u32, &[u8], &Hash) -> Result<(), ScanError>,
) -> Result<Vec<Hash>, ScanError> {
    read_chunks_owned(store, path, info, chunk_size, None, |i, buf, h| {
        on_chunk(i, buf, h)
    })
}

/// [`read_chunks`] for a caller that keeps some chunks' bytes: `on_chunk`
/// gets the buffer the chunk was read into and may take it
/// (`std::mem::take`), with no copy; the next chunk is then read into a
/// buffer from `pool` (or a new one), never zero-filled first. A buffer
/// left in place is reused.
///
/// # Errors
/// As [`read_chunks`].
pub fn read_chunks_owned(
    store: &dyn SourceStore,
    path: &Path,
    info: &FileInfo,
    chunk_size: u32,
    pool: Option<&crate::bufpool::BufPool>,
    on_chunk: impl FnMut(u32, &mut Vec<u8>, &Hash) -> Result<(), ScanError>,
) -> Result<Vec<Hash>, ScanError> {
    read_chunks_versioned(store, path, info, chunk_size, pool, on_chunk).map(|(h, _)| h)
}

/// [`read_chunks_owned`], also returning the file's [`FileVersion`] as
/// it was read: the same before and after the read, or
/// [`ScanError::Changed`] (a rewrite in place that restored the size and
/// mtime still moves the version).
///
/// # Errors
/// As [`read_chunks`].
pub fn read_chunks_versioned(
    store: &dyn SourceStore,
    path: &Path,
    info: &FileInfo,
    chunk_size: u32,
    pool: Option<&crate::bufpool::BufPool>,
    mut on_chunk: impl FnMut(u32, &mut Vec<u8>, &Hash) -> Result<(), ScanError>,
) -> Result<(Vec<Hash>, FileVersion), ScanError> {
    let io_err = |source| ScanError::Io {
        path: path.to_path_buf(),
        source,
    };
    let f = store.open(path).map_err(io_err)?;
    let (_, _, version_before) = f.current().map_err(io_err)?;
    let n = chunk_count(info.size, chunk_size);
    let mut hashes = Vec::with_capacity(n as usize);
    // Sized to the chunk read, not to `chunk_size`: most shards are far
    // smaller than a chunk, and zeroing a 4 MiB buffer per 4 KiB file
    // dominated the source's CPU time.
    let mut buf: Vec<u8> = Vec::new();
    for i in 0..n {
        let len = chunk_len(info.size, chunk_size, i) as usize;
        let offset = i * u64::from(chunk_size);
        if buf.capacity() == 0 {
            if let Some(p) = pool {
                buf = p.take(len);
            }
        }
        let read = f.read_range_into(offset, len as u64, &mut buf);
        read.map_err(|e| {
            if e.kind() == io::ErrorKind::UnexpectedEof {
                ScanError::Changed {
                    path: path.to_path_buf(),
                }
            } else {
                ScanError::Io {
                    path: path.to_path_buf(),
                    source: e,
                }
            }
        })?;
        let h = *blake3::hash(&buf).as_bytes();
        on_chunk(i as u32, &mut buf, &h)?;
        hashes.push(h);
    }
    if let Some(p) = pool {
        p.give(buf);
    }
    let (size, mtime_ns, version) = f.current().map_err(|e| ScanError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    if size != info.size || mtime_ns != info.mtime_ns || version != version_before {
        return Err(ScanError::Changed {
            path: path.to_path_buf(),
        });
    }
    Ok((hashes, version))
}

/// Builds the manifest of `dir` by listing it and reading every file once.
///
/// # Errors
/// As [`SourceStore::list`] and [`read_chunks`].
pub fn build(
    store: &dyn SourceStore,
    dir: &Path,
    markers: &[String],
    chunk_size: u32,
) -> Result<Manifest, ScanError> {
    let s = store.list(dir, markers)?;
    let mut files = Vec::with_capacity(s.files.len());
    for Listed { info, .. } in s.files {
        let chunks = read_chunks(
            store,
            &dir.join(&info.path),
            &info,
            chunk_size,
            |_, _, _| Ok(()),
        )?;
        files.push(FileEntry {
            path: info.path,
            size: info.size,
            mode: info.mode,
            mtime_ns: info.mtime_ns,
            chunks,
        });
    }
    Ok(Manifest {
        chunk_size,
        files,
        markers: s.markers,
    })
}

/// Adds `path` to an I/O error's message.
pub(crate) fn at(path: &Path) -> impl FnOnce(io::Error) -> io::Error + '_ {
    move |e| io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}
