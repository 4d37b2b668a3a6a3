//! The POSIX backend of the storage seams: local (or mounted) file
//! systems. Staging writes with `pwrite`, shares unchanged files with hard
//! links, publishes with `rename` (or `RENAME_EXCHANGE` over an older
//! version, [`publish`]), flushes with `syncfs` (one run shared by
//! callers close together, [`SyncGroup`]), reports free space with
//! `statvfs`.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use ferry_proto::manifest::{Hash, Manifest};

use super::{
    at, FileVersion, Listed, Listing, PublishOutcome, RangeRead, ScanError, SinkStore, SourceStore,
    Staging, Watch, WatchEvent, WatchHandler,
};

pub mod publish;
pub mod scan;

/// Local file systems.
#[derive(Debug, Clone, Copy, Default)]
pub struct Posix;

/// The version token of a file from its metadata: inode, size, mtime and
/// ctime (both in ns).
pub(crate) fn version_of(md: &std::fs::Metadata) -> FileVersion {
    FileVersion([
        md.ino(),
        md.len(),
        (md.mtime() * 1_000_000_000 + md.mtime_nsec()) as u64,
        (md.ctime() * 1_000_000_000 + md.ctime_nsec()) as u64,
    ])
}

/// An open local file.
struct PosixFile {
    file: File,
}

impl RangeRead for PosixFile {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn read_range(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let mut data = Vec::with_capacity(len as usize);
        self.read_range_into(offset, len, &mut data)?;
        Ok(data)
    }

    fn read_range_into(&self, offset: u64, len: u64, data: &mut Vec<u8>) -> io::Result<()> {
        // Read into the buffer's uninitialised capacity (no zero fill):
        // seek, then read_to_end on at most `len` bytes.
        data.clear();
        data.reserve(len as usize);
        let mut r: &File = &self.file;
        r.seek(io::SeekFrom::Start(offset))?;
        r.take(len).read_to_end(data)?;
        if data.len() as u64 != len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{} bytes at {offset}, expected {len}", data.len()),
            ));
        }
        Ok(())
    }

    fn current(&self) -> io::Result<(u64, i64, FileVersion)> {
        let md = self.file.metadata()?;
        Ok((
            md.len(),
            md.mtime() * 1_000_000_000 + md.mtime_nsec(),
            version_of(&md),
        ))
    }
}

/// An inotify watch (the `notify` crate); dropping it stops the watch.
struct PosixWatch {
    _watcher: notify::RecommendedWatcher,
}

impl Watch for PosixWatch {}

impl SourceStore for Posix {
    fn watch(&self, root: &Path, on_event: WatchHandler) -> io::Result<Option<Box<dyn Watch>>> {
        use notify::event::{AccessKind, AccessMode, EventKind, ModifyKind, RenameMode};
        use notify::Watcher as _;
        let handler = move |res: notify::Result<notify::Event>| match res {
            Ok(ev) => {
                if ev.need_rescan() {
                    on_event(WatchEvent::Overflow);
                }
                // Opens, reads and closes without a write change nothing,
                // and the watcher's own scans (and a pool's fingerprints)
                // make them: waking on them would make every scan wake
                // the next, about 50 a second.
                if matches!(
                    ev.kind,
                    EventKind::Access(
                        AccessKind::Open(_)
                            | AccessKind::Read
                            | AccessKind::Any
                            | AccessKind::Other
                            | AccessKind::Close(AccessMode::Read | AccessMode::Execute)
                    )
                ) {
                    return;
                }
                on_event(WatchEvent::Touched(ev.paths.clone()));
                match (&ev.kind, ev.paths.as_slice()) {
                    (EventKind::Modify(ModifyKind::Name(RenameMode::Both)), [from, to]) => {
                        on_event(WatchEvent::Renamed {
                            from: from.clone(),
                            to: to.clone(),
                        });
                    }
                    (EventKind::Access(AccessKind::Close(AccessMode::Write)), paths) => {
                        for p in paths {
                            on_event(WatchEvent::ClosedAfterWrite(p.clone()));
                        }
                    }
                    _ => {}
                }
            }
            Err(_) => on_event(WatchEvent::Overflow),
        };
        let mut watcher = notify::recommended_watcher(handler).map_err(io::Error::other)?;
        watcher
            .watch(root, notify::RecursiveMode::Recursive)
            .map_err(io::Error::other)
            .map_err(at(root))?;
        Ok(Some(Box::new(PosixWatch { _watcher: watcher })))
    }

    fn list(&self, dir: &Path, markers: &[String]) -> Result<Listing, ScanError> {
        let s = scan::scan(
            dir,
            &scan::ScanOptions {
                markers: markers.to_vec(),
            },
        )?;
        Ok(Listing {
            files: s
                .files
                .into_iter()
                .zip(s.versions)
                .map(|(info, version)| Listed { info, version })
                .collect(),
            markers: s.markers,
        })
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn RangeRead>> {
        Ok(Box::new(PosixFile {
            file: File::open(path)?,
        }))
    }

    fn stat(&self, path: &Path) -> io::Result<(u64, i64, FileVersion)> {
        let md = std::fs::metadata(path)?;
        Ok((
            md.len(),
            md.mtime() * 1_000_000_000 + md.mtime_nsec(),
            version_of(&md),
        ))
    }
}

/// A staging directory; keeps the file it last wrote open, since chunks
/// of one file mostly arrive together.
struct PosixStaging {
    dir: PathBuf,
    current: Option<(String, File)>,
}

impl Staging for PosixStaging {
    fn stage_chunk(&mut self, rel: &str, offset: u64, bytes: &[u8]) -> io::Result<()> {
        if self.current.as_ref().map(|c| c.0.as_str()) != Some(rel) {
            self.current = Some((rel.to_string(), open_staging(&self.dir, rel)?));
        }
        match &self.current {
            Some((_, f)) => f.write_all_at(bytes, offset),
            None => Err(io::Error::other("no staging file open")),
        }
    }
}

impl SinkStore for Posix {
    fn staging(&self, dir: &Path) -> Box<dyn Staging> {
        Box::new(PosixStaging {
            dir: dir.to_path_buf(),
            current: None,
        })
    }

    fn share_unchanged(&self, previous: &Path, staging: &Path, rel: &str) -> io::Result<()> {
        let dst = staging.join(rel);
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(at(parent))?;
        }
        let src = previous.join(rel);
        std::fs::hard_link(&src, &dst).map_err(at(&src))
    }

    fn link_staged(
        &self,
        from: &Path,
        to: &Path,
        f: &ferry_proto::manifest::FileEntry,
    ) -> io::Result<()> {
        let src = from.join(&f.path);
        let file = std::fs::File::open(&src).map_err(at(&src))?;
        if !file.metadata().map_err(at(&src))?.is_file() {
            return Err(io::Error::other(format!(
                "staging file {} is not a regular file",
                src.display()
            )));
        }
        file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(
            f.mode & 0o7777,
        ))
        .map_err(at(&src))?;
        let mtime =
            std::time::UNIX_EPOCH + std::time::Duration::from_nanos(f.mtime_ns.max(0) as u64);
        file.set_modified(mtime).map_err(at(&src))?;
        self.share_unchanged(from, to, &f.path)
    }

    fn publish(
        &self,
        staging: &Path,
        local_path: &Path,
        version: &Path,
        m: &Manifest,
        reread: Option<&[(u64, Hash)]>,
        _readers: Option<u64>,
    ) -> io::Result<PublishOutcome> {
        publish::publish(staging, local_path, version, m, reread)
    }

    fn versioned(&self) -> bool {
        true
    }

    fn list_names(&self, dir: &Path) -> io::Result<Vec<String>> {
        match std::fs::read_dir(dir) {
            Ok(rd) => Ok(rd
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(at(dir)(e)),
        }
    }

    fn hard_links(&self) -> bool {
        true
    }

    fn check_pool_ready(&self, dir: &Path) -> io::Result<()> {
        publish::check_pool_ready(dir)
    }

    fn named_version(&self, local_path: &Path) -> io::Result<Option<PathBuf>> {
        publish::named_version(local_path)
    }

    fn adopt(&self, local_path: &Path, version: &Path) -> io::Result<bool> {
        publish::adopt(local_path, version)
    }

    fn publish_under_way(&self, staging: &Path) -> bool {
        publish::under_way(staging)
    }

    fn publish_recorded(&self, staging: &Path) -> io::Result<()> {
        publish::finish(staging)
    }

    fn discard(&self, staging: &Path) -> io::Result<()> {
        for dir in [staging.with_extension("markers"), staging.to_path_buf()] {
            match std::fs::remove_dir_all(&dir) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(at(&dir)(e)),
                _ => {}
            }
        }
        Ok(())
    }

    fn withdraw(
        &self,
        local_path: &Path,
        version: &Path,
        aside: &Path,
        _keep: &[PathBuf],
    ) -> io::Result<bool> {
        // Versions share files by hard links: nothing to keep by name.
        if let Some(parent) = aside.parent() {
            std::fs::create_dir_all(parent).map_err(at(parent))?;
        }
        let exists = |p: &Path| std::fs::symlink_metadata(p).is_ok();
        let mut moved = false;
        if publish::names(local_path, version) {
            // Out of the published namespace in one step: the link goes.
            std::fs::remove_file(local_path).map_err(at(local_path))?;
            moved = true;
        } else if !exists(version)
            && std::fs::symlink_metadata(local_path).is_ok_and(|m| m.is_dir())
        {
            // Published before version directories: the directory itself
            // moves aside.
            rename_aside(local_path, aside)?;
            moved = true;
        }
        if exists(version) {
            rename_aside(version, aside)?;
            moved = true;
        }
        if !moved {
            return Ok(false);
        }
        // The move is durable before the files go.
        for dir in [local_path.parent(), version.parent(), aside.parent()]
            .into_iter()
            .flatten()
        {
            if dir.exists() {
                File::open(dir)
                    .and_then(|d| d.sync_all())
                    .map_err(at(dir))?;
            }
        }
        publish::fault_point("withdrawn");
        Ok(true)
    }

    fn retire(&self, aside: &Path) -> io::Result<()> {
        let mut removed = 0u64;
        match remove_tree(aside, &mut removed) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }

    fn free_space(&self, path: &Path) -> io::Result<Option<u64>> {
        let s = nix::sys::statvfs::statvfs(path)
            .map_err(io::Error::from)
            .map_err(at(path))?;
        Ok(Some(s.blocks_available() as u64 * s.fragment_size() as u64))
    }

    fn capacity(&self, path: &Path) -> io::Result<Option<u64>> {
        let s = nix::sys::statvfs::statvfs(path)
            .map_err(io::Error::from)
            .map_err(at(path))?;
        Ok(Some(s.blocks() as u64 * s.fragment_size() as u64))
    }

    fn flush(&self, dir: &Path) -> io::Result<()> {
        sync_dir_fs(dir).map_err(at(dir))
    }

    fn make_dir(&self, dir: &Path) -> io::Result<()> {
        std::fs::create_dir_all(dir).map_err(at(dir))
    }

    fn exists(&self, path: &Path) -> io::Result<bool> {
        match std::fs::symlink_metadata(path) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(at(path)(e)),
        }
    }

    fn read_small(&self, path: &Path) -> io::Result<Option<Vec<u8>>> {
        match std::fs::symlink_metadata(path) {
            Ok(md) if !md.is_file() => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}: not a regular file", path.display()),
            )),
            Ok(_) => std::fs::read(path).map(Some).map_err(at(path)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(at(path)(e)),
        }
    }

    fn replace_small(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: not a file path", path.display()),
            ));
        };
        std::fs::create_dir_all(parent).map_err(at(parent))?;
        let tmp = parent.join(format!(".{}.ferry-tmp", name.to_string_lossy()));
        {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(&tmp)
                .map_err(at(&tmp))?;
            io::Write::write_all(&mut f, bytes).map_err(at(&tmp))?;
            f.sync_all().map_err(at(&tmp))?;
        }
        std::fs::rename(&tmp, path).map_err(at(path))?;
        File::open(parent)
            .and_then(|d| d.sync_all())
            .map_err(at(parent))
    }
}

/// Renames `from` to `aside`, naming both in an error.
fn rename_aside(from: &Path, aside: &Path) -> io::Result<()> {
    std::fs::rename(from, aside).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!(
                "moving {} aside to {}: {e}",
                from.display(),
                aside.display()
            ),
        )
    })
}

/// Deletes the tree at `path` (files first, then each directory), without
/// following symlinks; `removed` counts the files deleted (a kill point of
/// the reliability suite, `retire-partial`, lies after the first).
fn remove_tree(path: &Path, removed: &mut u64) -> io::Result<()> {
    let md = std::fs::symlink_metadata(path).map_err(at(path))?;
    if md.is_dir() {
        for e in std::fs::read_dir(path).map_err(at(path))? {
            remove_tree(&e.map_err(at(path))?.path(), removed)?;
        }
        std::fs::remove_dir(path).map_err(at(path))
    } else {
        std::fs::remove_file(path).map_err(at(path))?;
        *removed += 1;
        if *removed == 1 {
            publish::fault_point("retire-partial");
        }
        Ok(())
    }
}

/// Opens (creating) a staging file without following a symlink at its
/// name or at any of its parent directories below `staging`; missing
/// parents are created as plain directories. A symlink planted in staging
/// (pointing outside the sink root) is refused, never written through.
pub(crate) fn open_staging(staging: &Path, rel: &str) -> io::Result<std::fs::File> {
    let p = staging.join(rel);
    if !staging.exists() {
        std::fs::create_dir_all(staging)?;
    }
    if let Some(parent) = Path::new(rel).parent() {
        let mut dir = staging.to_path_buf();
        for c in parent.components() {
            dir.push(c);
            match std::fs::symlink_metadata(&dir) {
                Ok(m) if m.is_dir() => {}
                Ok(_) => {
                    return Err(io::Error::other(format!(
                        "{} is a symlink or not a directory; refusing to write through it",
                        dir.display()
                    )))
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    match std::fs::create_dir(&dir) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                            // Created concurrently: check it again.
                            if !std::fs::symlink_metadata(&dir)?.is_dir() {
                                return Err(io::Error::other(format!(
                                    "{} is a symlink or not a directory; refusing to write through it",
                                    dir.display()
                                )));
                            }
                        }
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => return Err(e),
            }
        }
    }
    let open = || {
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            // No write through a symlink, no wait for a FIFO's reader.
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
            .open(&p)
            .map_err(|e| {
                let what = if e.raw_os_error() == Some(nix::libc::ELOOP) {
                    "is a symlink; refusing to write through it".to_string()
                } else {
                    e.to_string()
                };
                io::Error::new(e.kind(), format!("staging file {}: {what}", p.display()))
            })
            .and_then(|f| {
                if f.metadata()?.is_file() {
                    Ok(f)
                } else {
                    Err(io::Error::other(format!(
                        "staging file {} is not a regular file",
                        p.display()
                    )))
                }
            })
    };
    let file = open()?;
    // A file hard-linked from a published replica (see `reuse_published`)
    // must never be written in place: that would change the published
    // copy. Give staging its own copy first.
    if std::os::unix::fs::MetadataExt::nlink(&file.metadata()?) > 1 {
        drop(file);
        let private = p.with_extension("ferry-cow");
        std::fs::copy(&p, &private)?;
        std::fs::rename(&private, &p)?;
        return open();
    }
    Ok(file)
}

/// `syncfs` of the file system holding `dir`, shared with callers that ask
/// at the same time (group commit): a `syncfs` that starts after this call
/// began covers everything written before it, so callers that arrive
/// while one runs wait for the next one, and all of them share it. Many
/// publishes close together then cost one or two `syncfs` calls, not one
/// each.
///
/// # Errors
/// I/O errors of opening `dir` or of the `syncfs` that covered this call.
pub(crate) fn sync_dir_fs(dir: &Path) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let d = std::fs::File::open(dir)?;
    let dev = d.metadata()?.dev();
    group_of(dev).sync(|| nix::unistd::syncfs(d.as_raw_fd()).map_err(io::Error::from))
}

/// The [`SyncGroup`] of file system `dev` (one per device for the life of
/// the process; a host has few).
fn group_of(dev: u64) -> std::sync::Arc<SyncGroup> {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};
    static GROUPS: OnceLock<Mutex<HashMap<u64, Arc<SyncGroup>>>> = OnceLock::new();
    let mut m = crate::lock::lock(GROUPS.get_or_init(Default::default));
    m.entry(dev).or_default().clone()
}

/// Callers of one flush operation (a `syncfs` of one file system) that
/// share runs: at most one runs at a time, and a caller returns the result
/// of the first run that started after it called.
#[derive(Debug, Default)]
pub(crate) struct SyncGroup {
    state: std::sync::Mutex<SyncState>,
    done_cv: std::sync::Condvar,
}

#[derive(Debug, Default)]
struct SyncState {
    /// Runs started so far.
    started: u64,
    /// The last run that finished (runs finish in order: one at a time).
    finished: u64,
    /// A run is going on now.
    running: bool,
    /// Callers waiting for a run.
    waiting: usize,
    /// The error of run `finished`, if it failed (kind and message).
    failed: Option<(io::ErrorKind, String)>,
}

impl SyncGroup {
    /// Runs `op`, or waits for a run of it that started after this call
    /// and shares its result.
    ///
    /// # Errors
    /// The error of the run that covered this call.
    pub(crate) fn sync(&self, op: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        let mut s = crate::lock::lock(&self.state);
        // A run that started before now may have missed this caller's
        // writes; the next one to start will not.
        let need = s.started + 1;
        loop {
            if s.finished >= need {
                return match &s.failed {
                    None => Ok(()),
                    Some((kind, msg)) => Err(io::Error::new(*kind, msg.clone())),
                };
            }
            if !s.running {
                s.running = true;
                s.started += 1;
                let mine = s.started;
                drop(s);
                // Marks the run finished even if `op` panics, so waiters
                // are never left behind a run that will not end.
                let mut finish = Finish {
                    group: self,
                    run: mine,
                    failed: Some((io::ErrorKind::Other, "the flush panicked".into())),
                };
                let r = op();
                finish.failed = r.as_ref().err().map(|e| (e.kind(), e.to_string()));
                return r;
            }
            s.waiting += 1;
            s = self
                .done_cv
                .wait(s)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            s.waiting -= 1;
        }
    }
}

/// Ends run `run` of `group` when dropped, with `failed` as its result.
struct Finish<'a> {
    group: &'a SyncGroup,
    run: u64,
    failed: Option<(io::ErrorKind, String)>,
}

impl Drop for Finish<'_> {
    fn drop(&mut self) {
        let mut s = crate::lock::lock(&self.group.state);
        s.running = false;
        s.finished = self.run;
        s.failed = self.failed.take();
        self.group.done_cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Callers that arrive while a run is going wait for the next run and
    /// share it: eight callers behind one run cost one more run, not eight.
    #[test]
    fn flushes_close_together_share_a_run() {
        use std::sync::atomic::{AtomicU64, Ordering};
        use std::sync::{mpsc, Arc};
        let g = Arc::new(SyncGroup::default());
        let runs = Arc::new(AtomicU64::new(0));
        let (release, held) = mpsc::channel::<()>();
        let first = {
            let (g, runs) = (g.clone(), runs.clone());
            std::thread::spawn(move || {
                g.sync(|| {
                    runs.fetch_add(1, Ordering::SeqCst);
                    held.recv().map_err(io::Error::other)
                })
            })
        };
        let waiting = |n: usize| {
            for _ in 0..2000 {
                let s = crate::lock::lock(&g.state);
                if s.running && s.waiting == n {
                    return;
                }
                drop(s);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            panic!("{n} callers never waited");
        };
        waiting(0);
        let later: Vec<_> = (0..8)
            .map(|_| {
                let (g, runs) = (g.clone(), runs.clone());
                std::thread::spawn(move || {
                    g.sync(|| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    })
                })
            })
            .collect();
        // All eight called while the first run was going: none of them
        // may be answered by it (it may have missed their writes).
        waiting(8);
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        release.send(()).expect("release");
        first.join().expect("thread").expect("first run");
        for t in later {
            t.join().expect("thread").expect("shared run");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    /// A failed run's error reaches every caller it covered; the next run
    /// starts afresh.
    #[test]
    fn a_failed_flush_fails_its_callers_then_recovers() {
        let g = SyncGroup::default();
        let e = g
            .sync(|| Err(io::Error::other("disk gone")))
            .expect_err("the run failed");
        assert!(e.to_string().contains("disk gone"), "{e}");
        assert!(g.sync(|| Ok(())).is_ok());
        // A panicking run leaves no waiter stuck.
        let r =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| g.sync(|| panic!("boom"))));
        assert!(r.is_err());
        assert!(g.sync(|| Ok(())).is_ok());
    }

    /// A file linked into a weights-only version's staging area gets its
    /// final mode and mtime first (so its publish keeps the link instead
    /// of copying), and a later write into the transfer's staging area
    /// copies first: the linked bytes stay.
    #[test]
    fn a_file_linked_between_staging_areas_is_shared_until_written() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().expect("tempdir");
        let (staging, weights) = (d.path().join("staging"), d.path().join("weights"));
        let mut st = Posix.staging(&staging);
        st.stage_chunk("w/model.pt", 0, b"weights v1")
            .expect("stage");
        drop(st);
        let f = ferry_proto::manifest::FileEntry {
            path: "w/model.pt".into(),
            size: 10,
            mode: 0o640,
            mtime_ns: 1_700_000_000_123_456_789,
            chunks: Vec::new(),
        };
        Posix.link_staged(&staging, &weights, &f).expect("link");
        let md = |p: &Path| std::fs::metadata(p.join("w/model.pt")).expect("stat");
        assert_eq!(md(&staging).ino(), md(&weights).ino());
        assert_eq!(md(&weights).mode() & 0o7777, 0o640);
        assert_eq!(
            md(&weights).mtime() * 1_000_000_000 + md(&weights).mtime_nsec(),
            f.mtime_ns
        );
        let mut st = Posix.staging(&staging);
        st.stage_chunk("w/model.pt", 0, b"weights v2")
            .expect("stage");
        drop(st);
        let read = |p: &Path| std::fs::read(p.join("w/model.pt")).expect("read");
        assert_eq!(read(&weights), b"weights v1");
        assert_eq!(read(&staging), b"weights v2");
        assert_ne!(md(&staging).ino(), md(&weights).ino());
    }

    #[test]
    fn staging_files_refuse_symlinks() {
        let d = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink("/etc/passwd", d.path().join("evil")).expect("symlink");
        assert!(open_staging(d.path(), "evil").is_err());
        assert!(open_staging(d.path(), "a/b/c").is_ok());
        // A symlinked parent directory is refused too, not written through.
        let outside = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink(outside.path(), d.path().join("dir")).expect("symlink");
        assert!(open_staging(d.path(), "dir/x").is_err());
        assert!(open_staging(d.path(), "a/dir/x").is_ok());
        std::os::unix::fs::symlink(outside.path(), d.path().join("a/b/link")).expect("symlink");
        assert!(open_staging(d.path(), "a/b/link/deeper/x").is_err());
        assert_eq!(
            std::fs::read_dir(outside.path()).expect("read_dir").count(),
            0
        );
        // A missing staging directory is created.
        assert!(open_staging(&d.path().join("new"), "p/q").is_ok());
    }
}
