//! Publishing a replica (DESIGN.md, data path step 6): the staging
//! directory is read back and checked against the sealed manifest, moved
//! into its own version directory, and the published path, a symbolic
//! link, is switched to it in one `rename`. A publish that a crash
//! interrupted is finished from what is on disk.
//!
//! On disk, a publish of staging directory `S` to local path `L` as
//! version directory `V` (`<root>/.ferry/versions/<row id>`) goes:
//!
//! 1. every staged chunk is read back and hashed; chunks that no longer
//!    match the manifest (changed on disk since they were verified on
//!    arrival) are returned to be fetched again, and nothing moves;
//! 2. files the manifest does not list are removed, sizes, modes and
//!    mtimes set, the file system synced;
//! 3. the commit markers are moved aside into `S.markers/<i>` (the i-th
//!    marker of the manifest): from here until step 7, `S.markers`
//!    existing means a publish is under way;
//! 4. `S` is renamed to `V` (no published path names `V` yet);
//! 5. the markers are moved into `V`, in the manifest's order, and `V` is
//!    synced;
//! 6. a symbolic link to `V` (relative, so the sink root may be mounted
//!    elsewhere) is made at `V.link` and exchanged with `L` in one
//!    `renameat2(RENAME_EXCHANGE)` (or renamed to `L` when nothing is
//!    there); what `L` was (the link to the older version, or the
//!    directory of a replica published before version directories) is
//!    then at `V.link` and is removed. The older version's directory
//!    stays: the sink deletes it once no reader lease holds it;
//! 7. once the catalog has recorded the replica, [`finish`] removes
//!    `S.markers`.
//!
//! A reader of `L` therefore sees the whole older version or the whole
//! new one, markers included, and a reader given `V` (a leased path) sees
//! `V` for as long as it exists, whatever is published at `L` later. From
//! step 3 until the catalog knows, `S.markers` says a publish to `L` is
//! under way ([`under_way`]; resolve does not answer with an older
//! version of `L` meanwhile). After a crash, [`publish`] finds `S.markers`
//! and finishes the steps left.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, UNIX_EPOCH};

use ferry_proto::manifest::{chunk_count, chunk_len, Hash, Manifest};
use tracing::warn;

use crate::storage::{PublishOutcome, ReadBack};

/// Environment variable of the reliability suite: when it names one of the
/// points `markers-held`, `placed`, `markers-in` or `switched` (after
/// steps 3, 4, 5 and 6 of a fresh publish), `on-disk` (after the publish,
/// before the catalog
/// records it), `withdrawn` (a removed replica moved aside, before its
/// files are deleted) or `retire-partial` (after the first file of a
/// removed replica is deleted), the sink SIGKILLs itself there. On an
/// HDFS sink `placed` is after the publish note, before any rename, and
/// `switched` after the replica directory is renamed in, before its
/// markers; on an S3 sink `placed` is before the first file is written
/// and `markers-in` after the last, before the commit object. Read only
/// in builds with the `fault-injection` feature.
pub const FAULT_KILL_ENV: &str = "FERRY_FAULT_KILL_IN_PUBLISH";

/// SIGKILLs this process if [`FAULT_KILL_ENV`] names `point`.
#[cfg(feature = "fault-injection")]
pub(crate) fn fault_point(point: &str) {
    static AT: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    if AT
        .get_or_init(|| std::env::var(FAULT_KILL_ENV).ok())
        .as_deref()
        == Some(point)
    {
        warn!(
            point,
            "fault injection: killing this agent ({FAULT_KILL_ENV})"
        );
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    }
}

/// Without the `fault-injection` feature there is no kill point.
#[cfg(not(feature = "fault-injection"))]
pub(crate) fn fault_point(_point: &str) {}

fn held_dir(staging: &Path) -> PathBuf {
    staging.with_extension("markers")
}

/// Whether a publish from `staging` has begun moving things and the
/// catalog has not yet recorded it (steps 3 to 6; its held-markers
/// directory exists): the published path may then hold the new version,
/// the old one, or the new one without its markers.
pub(super) fn under_way(staging: &Path) -> bool {
    held_dir(staging).exists()
}

/// Step 7, once the catalog has recorded the replica published from
/// `staging`: the publish is no longer under way.
///
/// # Errors
/// I/O errors naming the directory.
pub(super) fn finish(staging: &Path) -> io::Result<()> {
    let held = held_dir(staging);
    if held.exists() {
        std::fs::remove_dir_all(&held).map_err(at(&held))?;
    }
    if let Some(parent) = held.parent() {
        File::open(parent)
            .and_then(|d| d.sync_all())
            .map_err(at(parent))?;
    }
    Ok(())
}

/// Adds `path` to an I/O error's message.
fn at(path: &Path) -> impl FnOnce(io::Error) -> io::Error + '_ {
    move |e| io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// Opens `path` for reading without following a symlink at its name and
/// without blocking on a FIFO; refuses anything but a regular file.
fn open_regular(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    if !file.metadata()?.is_file() {
        return Err(io::Error::other(format!(
            "{} is not a regular file",
            path.display()
        )));
    }
    Ok(file)
}

/// Publishes staging directory `staging` at `local_path` as the checkpoint
/// `m`, in version directory `version`. With `reread`, the chunk keys of `m` as the sink's file table
/// numbers them, one per chunk in manifest order (files in order, chunks
/// in order), staging is read back first (step 1); without, step 1 is
/// skipped. Finishes an interrupted publish of the same transfer first if
/// there is one (see the module docs).
///
/// # Errors
/// I/O errors naming the path, and a refusal when an interrupted publish
/// left no directory holding the verified checkpoint.
pub(super) fn publish(
    staging: &Path,
    local_path: &Path,
    version: &Path,
    m: &Manifest,
    reread: Option<&[(u64, Hash)]>,
) -> io::Result<PublishOutcome> {
    let held = held_dir(staging);
    if held.exists() {
        resume(staging, local_path, version, m, &held)?;
        return Ok(PublishOutcome::Recovered);
    }
    if !has_files(staging)?
        && names(local_path, version)
        && version.is_dir()
        && matches(version, m, &|_| None)?
    {
        // Published before a crash that came before the catalog heard of it.
        if staging.exists() {
            std::fs::remove_dir_all(staging).map_err(at(staging))?;
        }
        return Ok(PublishOutcome::Recovered);
    }
    let mut reread_took = None;
    if let Some(keys) = reread {
        let t = std::time::Instant::now();
        let (bad, cpu) = changed_chunks(staging, m, keys);
        if !bad.is_empty() {
            return Ok(PublishOutcome::Refetch(bad));
        }
        reread_took = Some(ReadBack {
            wall: t.elapsed(),
            cpu,
        });
    }
    remove_unlisted(staging, m)?;
    if local_path.exists() && !local_path.is_dir() {
        return Err(io::Error::other(format!(
            "{} exists and is not a directory",
            local_path.display()
        )));
    }
    if std::fs::symlink_metadata(version).is_ok() {
        return Err(io::Error::other(format!(
            "{} exists already; another publish of this transfer left it",
            version.display()
        )));
    }
    for f in &m.files {
        let p = staging.join(&f.path);
        // Read-only: files hard-linked from the previous version stay
        // shared (modes and times are set to the same values).
        let mut file = match open_regular(&p) {
            Ok(file) => file,
            Err(e) if e.kind() == io::ErrorKind::NotFound && f.size == 0 => {
                super::open_staging(staging, &f.path)?
            }
            Err(e) => return Err(e),
        };
        let md = file.metadata()?;
        if md.nlink() > 1
            && (md.mode() & 0o7777 != f.mode & 0o7777
                || md.mtime() * 1_000_000_000 + md.mtime_nsec() != f.mtime_ns.max(0))
        {
            // Shared with the published version, whose mode or mtime must
            // not change: staging gets its own copy first.
            drop(file);
            file = super::open_staging(staging, &f.path)?;
        }
        let mut len = md.len();
        if len > f.size {
            // The file was rewritten shorter at the source while it was
            // being copied: every chunk of the final content is verified,
            // the bytes past its end are stale.
            drop(file);
            file = super::open_staging(staging, &f.path)?;
            file.set_len(f.size)?;
            len = f.size;
        }
        if len != f.size {
            return Err(io::Error::other(format!(
                "{} has {len} bytes, expected {}",
                p.display(),
                f.size
            )));
        }
        file.set_permissions(std::fs::Permissions::from_mode(f.mode & 0o7777))?;
        file.set_modified(mtime(f.mtime_ns))?;
    }
    super::sync_dir_fs(staging).map_err(at(staging))?;
    std::fs::create_dir_all(&held).map_err(at(&held))?;
    for (i, mi) in m.markers.iter().enumerate() {
        let f = &m.files[*mi as usize];
        let from = staging.join(&f.path);
        std::fs::rename(&from, held.join(i.to_string())).map_err(at(&from))?;
    }
    fault_point("markers-held");
    place(staging, version)?;
    fault_point("placed");
    markers_in(version, m, &held)?;
    fault_point("markers-in");
    switch(local_path, version)?;
    fault_point("switched");
    Ok(PublishOutcome::Published {
        hot: None,
        reread: reread_took,
    })
}

/// Finishes a publish interrupted after its markers were moved aside.
fn resume(
    staging: &Path,
    local_path: &Path,
    version: &Path,
    m: &Manifest,
    held: &Path,
) -> io::Result<()> {
    if !version.is_dir() {
        let aside: HashMap<usize, PathBuf> = m
            .markers
            .iter()
            .enumerate()
            .map(|(i, mi)| (*mi as usize, held.join(i.to_string())))
            .collect();
        let overlay = |fi: usize| aside.get(&fi).filter(|p| p.exists()).cloned();
        if staging.is_dir() && matches(staging, m, &overlay)? {
            place(staging, version)?;
        } else if is_real_dir(local_path) && matches(local_path, m, &overlay)? {
            // A publish by a release before version directories moved the
            // checkpoint to `local_path` itself: it becomes this version.
            adopt(local_path, version)?;
        } else {
            return Err(io::Error::other(format!(
                "an earlier publish of this transfer was interrupted, and neither {} nor {} \
                 holds the verified checkpoint; push the checkpoint again",
                staging.display(),
                local_path.display()
            )));
        }
    }
    markers_in(version, m, held)?;
    switch(local_path, version)?;
    if staging.exists() {
        std::fs::remove_dir_all(staging).map_err(at(staging))?;
    }
    Ok(())
}

/// Step 4: `staging` becomes the version directory `version`.
fn place(staging: &Path, version: &Path) -> io::Result<()> {
    if let Some(parent) = version.parent() {
        std::fs::create_dir_all(parent).map_err(at(parent))?;
    }
    std::fs::rename(staging, version).map_err(at(version))
}

/// Step 5: every marker still set aside moves into `version`, in the
/// manifest's order; then `version` is synced.
fn markers_in(version: &Path, m: &Manifest, held: &Path) -> io::Result<()> {
    for (i, mi) in m.markers.iter().enumerate() {
        let from = held.join(i.to_string());
        if from.exists() {
            let f = &m.files[*mi as usize];
            let to = version.join(&f.path);
            std::fs::rename(&from, &to).map_err(at(&to))?;
        }
    }
    File::open(version)
        .and_then(|d| d.sync_all())
        .map_err(at(version))
}

/// Where step 6 makes the new link before it moves to the published path
/// (and where what the published path was waits for its removal).
fn link_aside(version: &Path) -> PathBuf {
    version.with_extension("link")
}

/// Whether `path` is a directory itself, not a link to one.
fn is_real_dir(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.is_dir())
}

/// The relative path from directory `from` to `to` (both absolute and
/// lexically normal, as the sink's paths are).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let (f, t): (Vec<_>, Vec<_>) = (from.components().collect(), to.components().collect());
    let common = f.iter().zip(&t).take_while(|(a, b)| a == b).count();
    let mut out = PathBuf::new();
    for _ in common..f.len() {
        out.push("..");
    }
    for c in &t[common..] {
        out.push(c.as_os_str());
    }
    out
}

/// The link text that makes `local_path` name `version`.
fn link_text(local_path: &Path, version: &Path) -> PathBuf {
    relative(local_path.parent().unwrap_or(Path::new("/")), version)
}

/// Whether `local_path` is a link naming `version`.
pub(super) fn names(local_path: &Path, version: &Path) -> bool {
    std::fs::read_link(local_path).is_ok_and(|t| t == link_text(local_path, version))
}

/// The version directory the link at `local_path` names: `None` when
/// nothing is there, or a directory (published before version
/// directories).
///
/// # Errors
/// I/O errors naming the path.
pub(super) fn named_version(local_path: &Path) -> io::Result<Option<PathBuf>> {
    match std::fs::read_link(local_path) {
        Ok(t) => {
            let base = local_path.parent().unwrap_or(Path::new("/"));
            Ok(Some(normal(&base.join(t))))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::InvalidInput => Ok(None),
        Err(e) => Err(at(local_path)(e)),
    }
}

/// `path` with `.` and `..` components resolved lexically.
fn normal(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            c => out.push(c.as_os_str()),
        }
    }
    out
}

/// Step 6: `local_path` becomes a link to `version` in one step; what was
/// there (a link to an older version, or a directory published before
/// version directories) is removed after. Nothing to do when it names
/// `version` already.
fn switch(local_path: &Path, version: &Path) -> io::Result<()> {
    let tmp = link_aside(version);
    if !names(local_path, version) {
        if let Some(parent) = local_path.parent() {
            std::fs::create_dir_all(parent).map_err(at(parent))?;
        }
        remove_any(&tmp)?;
        std::os::unix::fs::symlink(link_text(local_path, version), &tmp).map_err(at(&tmp))?;
        if std::fs::symlink_metadata(local_path).is_ok() {
            nix::fcntl::renameat2(
                None,
                &tmp,
                None,
                local_path,
                nix::fcntl::RenameFlags::RENAME_EXCHANGE,
            )
            .map_err(io::Error::from)
            .map_err(at(local_path))?;
        } else {
            std::fs::rename(&tmp, local_path).map_err(at(local_path))?;
        }
        if let Some(parent) = local_path.parent() {
            File::open(parent)
                .and_then(|d| d.sync_all())
                .map_err(at(parent))?;
        }
    }
    remove_any(&tmp)
}

/// Removes what is at `path` (a link, a file or a tree), if anything.
fn remove_any(path: &Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path).map_err(at(path)),
        Ok(_) => std::fs::remove_file(path).map_err(at(path)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(at(path)(e)),
    }
}

/// Moves the directory at `local_path` (a replica published before
/// version directories) into `version`, leaving a link to it at
/// `local_path`, in one exchange: a reader of `local_path` sees the same
/// files throughout. False when `local_path` is not a directory.
///
/// # Errors
/// I/O errors naming the path; nothing moves then.
pub(super) fn adopt(local_path: &Path, version: &Path) -> io::Result<bool> {
    if !is_real_dir(local_path) {
        return Ok(false);
    }
    if std::fs::symlink_metadata(version).is_ok() {
        return Err(io::Error::other(format!(
            "{} exists already; {} stays where it is",
            version.display(),
            local_path.display()
        )));
    }
    if let Some(parent) = version.parent() {
        std::fs::create_dir_all(parent).map_err(at(parent))?;
    }
    // The link is made where the directory goes: after the exchange the
    // directory is there and the link at `local_path`, whose text is
    // relative to `local_path`'s directory.
    std::os::unix::fs::symlink(link_text(local_path, version), version).map_err(at(version))?;
    if let Err(e) = nix::fcntl::renameat2(
        None,
        version,
        None,
        local_path,
        nix::fcntl::RenameFlags::RENAME_EXCHANGE,
    ) {
        let _ = std::fs::remove_file(version);
        return Err(at(local_path)(io::Error::from(e)));
    }
    for dir in [local_path.parent(), version.parent()]
        .into_iter()
        .flatten()
    {
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(at(dir))?;
    }
    Ok(true)
}

/// Tries, in a scratch directory of its own under `dir`, the two things
/// a sink pool's publishes rely on: a hard link, and exchanging two
/// names with `renameat2(RENAME_EXCHANGE)`. The scratch directory is
/// removed after, whatever the outcome.
///
/// # Errors
/// An error naming the operation that failed and where.
pub(super) fn check_pool_ready(dir: &Path) -> io::Result<()> {
    // Unique across the hosts sharing the root (containers' agents may
    // all be process 1).
    let scratch = dir.join(format!(
        ".pool-check-{}-{:016x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    remove_any(&scratch)?;
    std::fs::create_dir_all(&scratch).map_err(at(&scratch))?;
    let tried = (|| {
        let (a, b, link) = (scratch.join("a"), scratch.join("b"), scratch.join("a.link"));
        std::fs::write(&a, b"a").map_err(at(&a))?;
        std::fs::write(&b, b"b").map_err(at(&b))?;
        std::fs::hard_link(&a, &link).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "a hard link ({} to {}) failed: {e}",
                    link.display(),
                    a.display()
                ),
            )
        })?;
        nix::fcntl::renameat2(None, &a, None, &b, nix::fcntl::RenameFlags::RENAME_EXCHANGE)
            .map_err(|e| {
                io::Error::other(format!(
                    "renameat2(RENAME_EXCHANGE) of {} and {} failed: {e}",
                    a.display(),
                    b.display()
                ))
            })?;
        if std::fs::read(&a).map_err(at(&a))? != b"b" {
            return Err(io::Error::other(format!(
                "renameat2(RENAME_EXCHANGE) of {} and {} did not exchange them",
                a.display(),
                b.display()
            )));
        }
        Ok(())
    })();
    let cleaned = remove_any(&scratch);
    tried.and(cleaned)
}

fn mtime(ns: i64) -> std::time::SystemTime {
    if ns >= 0 {
        UNIX_EPOCH + Duration::from_nanos(ns as u64)
    } else {
        UNIX_EPOCH
    }
}

/// Whether `dir` holds at least one entry other than directories.
fn has_files(dir: &Path) -> io::Result<bool> {
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    for e in rd {
        let e = e?;
        if !e.file_type()?.is_dir() || has_files(&e.path())? {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether `dir` holds exactly the published form of `m`: every file a
/// regular file with the manifest's size, mode and mtime and every chunk
/// hashing to the manifest's. `overlay(i)` names another place to read
/// file `i` from (a marker set aside).
fn matches(
    dir: &Path,
    m: &Manifest,
    overlay: &(dyn Fn(usize) -> Option<PathBuf> + Sync),
) -> io::Result<bool> {
    for (i, f) in m.files.iter().enumerate() {
        let p = overlay(i).unwrap_or_else(|| dir.join(&f.path));
        let md = match std::fs::symlink_metadata(&p) {
            Ok(md) => md,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(e),
        };
        let ns = md.mtime() * 1_000_000_000 + md.mtime_nsec();
        if !md.is_file()
            || md.len() != f.size
            || md.mode() & 0o7777 != f.mode & 0o7777
            || ns != f.mtime_ns.max(0)
        {
            return Ok(false);
        }
    }
    Ok(hash_mismatches(dir, m, overlay, true).0.is_empty())
}

/// Keys of the staged chunks whose bytes no longer hash to the manifest
/// (including chunks that cannot be read). `keys` as for [`publish`].
fn changed_chunks(staging: &Path, m: &Manifest, keys: &[(u64, Hash)]) -> (Vec<u64>, Duration) {
    let (bad, cpu) = hash_mismatches(staging, m, &|_| None, false);
    let keys = bad
        .into_iter()
        .filter_map(|n| keys.get(n).map(|(k, _)| *k))
        .collect();
    (keys, cpu)
}

/// Reads and hashes every chunk of `m` under `dir` on up to 4 threads;
/// returns the positions, in manifest order (files in order, chunks in
/// order), of the chunks that cannot be read or do not hash to the
/// manifest, and the CPU time the reading threads spent. With
/// `first_only` it stops at the first one found.
fn hash_mismatches(
    dir: &Path,
    m: &Manifest,
    overlay: &(dyn Fn(usize) -> Option<PathBuf> + Sync),
    first_only: bool,
) -> (Vec<usize>, Duration) {
    let chunks: Vec<(usize, u64)> = m
        .files
        .iter()
        .enumerate()
        .flat_map(|(i, f)| (0..chunk_count(f.size, m.chunk_size)).map(move |c| (i, c)))
        .collect();
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 4)
        .min(chunks.len().max(1));
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let bad = Mutex::new(Vec::new());
    let cpu_ns = AtomicU64::new(0);
    let cs = u64::from(m.chunk_size);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                // Each worker is a new thread: its CPU clock is its work.
                let _cpu = ThreadCpu(&cpu_ns);
                let mut open: Option<(usize, File)> = None;
                let mut buf = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(fi, ci)) = chunks.get(n) else {
                        break;
                    };
                    let f = &m.files[fi];
                    let ok = (|| -> io::Result<bool> {
                        if open.as_ref().is_none_or(|(i, _)| *i != fi) {
                            let p = overlay(fi).unwrap_or_else(|| dir.join(&f.path));
                            open = Some((fi, open_regular(&p)?));
                        }
                        let Some((_, file)) = &open else {
                            return Ok(false);
                        };
                        let len = chunk_len(f.size, m.chunk_size, ci) as usize;
                        buf.resize(len, 0);
                        file.read_exact_at(&mut buf, ci * cs)?;
                        let want = f.chunks.get(ci as usize);
                        Ok(want == Some(blake3::hash(&buf).as_bytes()))
                    })()
                    .unwrap_or(false);
                    if !ok {
                        {
                            let mut b = crate::lock::lock(&bad);
                            b.push(n);
                        }
                        if first_only {
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
    });
    let mut bad = bad.into_inner().unwrap_or_default();
    bad.sort_unstable();
    (bad, Duration::from_nanos(cpu_ns.into_inner()))
}

/// Adds the CPU time of the thread it was made on to its counter (ns)
/// when dropped, at the thread's end.
struct ThreadCpu<'a>(&'a AtomicU64);

impl Drop for ThreadCpu<'_> {
    fn drop(&mut self) {
        use nix::time::{clock_gettime, ClockId};
        if let Ok(t) = clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID) {
            let ns = t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64;
            self.0.fetch_add(ns, Ordering::Relaxed);
        }
    }
}

/// Removes files in staging that the sealed manifest does not list, so a
/// replica holds exactly the frozen file set.
fn remove_unlisted(staging: &Path, m: &Manifest) -> io::Result<()> {
    let listed: std::collections::HashSet<&str> = m.files.iter().map(|f| f.path.as_str()).collect();
    let scan = crate::storage::posix::scan::scan(staging, &Default::default()).map_err(|e| {
        io::Error::other(format!(
            "staging holds something the sink never wrote (another process in the sink root?): {e}"
        ))
    })?;
    for f in scan.files {
        if !listed.contains(f.path.as_str()) {
            warn!(path = %staging.join(&f.path).display(), "removing a staging file the manifest does not list");
            std::fs::remove_file(staging.join(&f.path))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::storage::build;
    use crate::storage::posix::Posix;

    const CHUNK: u32 = 64 * 1024;

    /// A source checkpoint: three data files (one of several chunks) and a
    /// `COMMITTED` marker, with its manifest.
    fn source(dir: &Path) -> Manifest {
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        std::fs::write(dir.join("a.bin"), vec![1u8; 200_000]).unwrap();
        std::fs::write(dir.join("sub/b.bin"), b"bee").unwrap();
        std::fs::write(dir.join("c.json"), b"{}").unwrap();
        std::fs::write(dir.join("COMMITTED"), b"").unwrap();
        build(&Posix, dir, &["COMMITTED".into()], CHUNK).unwrap()
    }

    /// Chunk keys numbered as a sink table would: file index << 32 | chunk.
    fn keys(m: &Manifest) -> Vec<(u64, Hash)> {
        let mut k = Vec::new();
        for (i, f) in m.files.iter().enumerate() {
            for (c, h) in f.chunks.iter().enumerate() {
                k.push(((i as u64) << 32 | c as u64, *h));
            }
        }
        k
    }

    /// Copies the bytes (not modes or times) of `from` into a staging
    /// directory, as chunks arriving would.
    fn stage(from: &Path, staging: &Path, m: &Manifest) {
        for f in &m.files {
            let to = staging.join(&f.path);
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(from.join(&f.path), &to).unwrap();
            std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
    }

    struct Case {
        _tmp: tempfile::TempDir,
        src: PathBuf,
        staging: PathBuf,
        local: PathBuf,
        version: PathBuf,
        m: Manifest,
    }

    fn case() -> Case {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        let m = source(&src);
        let staging = tmp.path().join(".ferry/staging/peer-1-abc");
        let local = tmp.path().join("site/job/step_100");
        let version = tmp.path().join(".ferry/versions/1");
        stage(&src, &staging, &m);
        Case {
            _tmp: tmp,
            src,
            staging,
            local,
            version,
            m,
        }
    }

    /// Every file of `m` at `dir` is byte-identical to the source, with
    /// its mode and mtime.
    fn assert_published(c: &Case) {
        assert!(
            names(&c.local, &c.version),
            "the published path names the version"
        );
        assert_eq!(
            named_version(&c.local).unwrap().as_deref(),
            Some(&*c.version)
        );
        assert!(
            !link_aside(&c.version).exists(),
            "the link's temporary name left behind"
        );
        assert!(matches(&c.local, &c.m, &|_| None).unwrap());
        for f in &c.m.files {
            assert_eq!(
                std::fs::read(c.local.join(&f.path)).unwrap(),
                std::fs::read(c.src.join(&f.path)).unwrap(),
                "{}",
                f.path
            );
        }
        assert!(!c.staging.exists(), "staging left behind");
        // Under way until the catalog is told (step 7).
        assert!(under_way(&c.staging), "held markers gone before step 7");
        finish(&c.staging).unwrap();
        assert!(!held_dir(&c.staging).exists(), "held markers left behind");
    }

    #[test]
    fn publishes_with_modes_times_and_markers() {
        let c = case();
        let out = publish(&c.staging, &c.local, &c.version, &c.m, Some(&keys(&c.m))).unwrap();
        // The read-back ran, on threads whose CPU time it counted.
        assert!(
            matches!(out, PublishOutcome::Published { reread: Some(r), .. } if r.cpu > Duration::ZERO),
            "{out:?}"
        );
        assert_published(&c);
        let src_md = std::fs::metadata(c.src.join("a.bin")).unwrap();
        let md = std::fs::metadata(c.local.join("a.bin")).unwrap();
        assert_eq!(md.mode() & 0o7777, src_md.mode() & 0o7777);
        assert_eq!(md.mtime_nsec(), src_md.mtime_nsec());
    }

    #[test]
    fn chunks_changed_in_staging_are_refetched_and_nothing_moves() {
        let c = case();
        // Second chunk of a.bin (file 0) and the only chunk of sub/b.bin.
        let a = OpenOptions::new()
            .write(true)
            .open(c.staging.join("a.bin"))
            .unwrap();
        a.write_all_at(&[9], u64::from(CHUNK) + 5).unwrap();
        std::fs::write(c.staging.join("sub/b.bin"), b"bea").unwrap();
        let ks = keys(&c.m);
        let b_index =
            c.m.files
                .iter()
                .position(|f| f.path == "sub/b.bin")
                .unwrap() as u64;
        let out = publish(&c.staging, &c.local, &c.version, &c.m, Some(&ks)).unwrap();
        assert_eq!(out, PublishOutcome::Refetch(vec![1, b_index << 32]));
        assert!(!c.local.exists());
        assert!(!held_dir(&c.staging).exists());
        // A missing file is refetched too.
        std::fs::remove_file(c.staging.join("c.json")).unwrap();
        let c_index = c.m.files.iter().position(|f| f.path == "c.json").unwrap() as u64;
        let out = publish(&c.staging, &c.local, &c.version, &c.m, Some(&ks)).unwrap();
        let mut want = vec![1, b_index << 32, c_index << 32];
        want.sort_unstable();
        assert_eq!(out, PublishOutcome::Refetch(want));
    }

    #[test]
    fn a_file_shared_with_the_published_version_keeps_its_mode_and_time() {
        let c = case();
        // As a re-save reuses a file: staging's a.bin is a hard link of the
        // published version's, whose mode and mtime differ from the new
        // manifest's.
        let published = c.src.parent().unwrap().join("published-a.bin");
        std::fs::hard_link(c.staging.join("a.bin"), &published).unwrap();
        let before = std::fs::metadata(&published).unwrap();
        publish(&c.staging, &c.local, &c.version, &c.m, Some(&keys(&c.m))).unwrap();
        let after = std::fs::metadata(&published).unwrap();
        assert_eq!(after.mode(), before.mode());
        assert_eq!(
            (after.mtime(), after.mtime_nsec()),
            (before.mtime(), before.mtime_nsec())
        );
        assert_published(&c);
    }

    #[test]
    fn special_files_in_staging_are_refetched_without_blocking() {
        let c = case();
        // A FIFO in place of a staged file: opening it for reading would
        // wait for a writer forever.
        std::fs::remove_file(c.staging.join("sub/b.bin")).unwrap();
        nix::unistd::mkfifo(
            &c.staging.join("sub/b.bin"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let b_index =
            c.m.files
                .iter()
                .position(|f| f.path == "sub/b.bin")
                .unwrap() as u64;
        let out = publish(&c.staging, &c.local, &c.version, &c.m, Some(&keys(&c.m))).unwrap();
        assert_eq!(out, PublishOutcome::Refetch(vec![b_index << 32]));
        // Without the read-back the move refuses it, naming the file.
        let err = publish(&c.staging, &c.local, &c.version, &c.m, None).unwrap_err();
        assert!(err.to_string().contains("sub/b.bin"), "{err}");
        assert!(!c.local.exists());
    }

    #[test]
    fn a_publish_is_under_way_from_the_held_markers_until_the_catalog_is_told() {
        let c = case();
        assert!(!under_way(&c.staging));
        up_to_markers_held(&c);
        assert!(under_way(&c.staging));
        place(&c.staging, &c.version).unwrap();
        // Staging moved away, the catalog not yet told.
        assert!(under_way(&c.staging));
        // Opening the transfer again re-creates staging: still under way.
        std::fs::create_dir_all(&c.staging).unwrap();
        assert!(under_way(&c.staging));
        finish(&c.staging).unwrap();
        assert!(!under_way(&c.staging));
    }

    #[test]
    fn without_the_read_back_staging_is_published_as_it_is() {
        let c = case();
        std::fs::write(c.staging.join("sub/b.bin"), b"bea").unwrap();
        let out = publish(&c.staging, &c.local, &c.version, &c.m, None).unwrap();
        assert_eq!(
            out,
            PublishOutcome::Published {
                reread: None,
                hot: None
            }
        );
        assert_eq!(std::fs::read(c.local.join("sub/b.bin")).unwrap(), b"bea");
    }

    /// Runs steps 2 and 3 of a publish (modes, times, markers aside).
    fn up_to_markers_held(c: &Case) -> PathBuf {
        for f in &c.m.files {
            let p = c.staging.join(&f.path);
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(f.mode & 0o7777)).unwrap();
            File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(mtime(f.mtime_ns))
                .unwrap();
        }
        let held = held_dir(&c.staging);
        std::fs::create_dir_all(&held).unwrap();
        for (i, mi) in c.m.markers.iter().enumerate() {
            let f = &c.m.files[*mi as usize];
            std::fs::rename(c.staging.join(&f.path), held.join(i.to_string())).unwrap();
        }
        held
    }

    #[test]
    fn a_crash_after_the_markers_were_set_aside_is_finished() {
        let c = case();
        up_to_markers_held(&c);
        let out = publish(&c.staging, &c.local, &c.version, &c.m, Some(&keys(&c.m))).unwrap();
        assert_eq!(out, PublishOutcome::Recovered);
        assert_published(&c);
    }

    #[test]
    fn a_crash_after_the_rename_is_finished() {
        let c = case();
        let held = up_to_markers_held(&c);
        place(&c.staging, &c.version).unwrap();
        // The sink re-creates an empty staging directory when the
        // transfer is opened again.
        std::fs::create_dir_all(&c.staging).unwrap();
        assert!(!c.local.join("COMMITTED").exists());
        let out = publish(&c.staging, &c.local, &c.version, &c.m, Some(&keys(&c.m))).unwrap();
        assert_eq!(out, PublishOutcome::Recovered);
        assert_published(&c);
        assert!(!held.exists());
    }

    #[test]
    fn a_crash_after_the_move_into_the_version_directory_leaves_an_older_replica_published() {
        let c = case();
        // An older replica published at the same path by a release before
        // version directories: a directory at the published path.
        std::fs::create_dir_all(&c.local).unwrap();
        std::fs::write(c.local.join("a.bin"), b"old").unwrap();
        std::fs::write(c.local.join("COMMITTED"), b"").unwrap();
        up_to_markers_held(&c);
        place(&c.staging, &c.version).unwrap();
        // Until the switch, readers of the published path see the old one.
        assert_eq!(std::fs::read(c.local.join("a.bin")).unwrap(), b"old");
        let out = publish(&c.staging, &c.local, &c.version, &c.m, Some(&keys(&c.m))).unwrap();
        assert_eq!(out, PublishOutcome::Recovered);
        assert_published(&c);
    }

    #[test]
    fn a_re_save_switches_the_link_and_leaves_the_older_version_whole() {
        let c = case();
        publish(&c.staging, &c.local, &c.version, &c.m, None).unwrap();
        finish(&c.staging).unwrap();
        // A reader given the version's own path.
        let leased = c.version.join("a.bin");
        let old_bytes = std::fs::read(&leased).unwrap();
        // The next version: a.bin rewritten.
        let src2 = c.src.parent().unwrap().join("src2");
        std::fs::create_dir_all(src2.join("sub")).unwrap();
        for f in &c.m.files {
            std::fs::copy(c.src.join(&f.path), src2.join(&f.path)).unwrap();
        }
        std::fs::write(src2.join("a.bin"), b"new bytes").unwrap();
        let m2 = build(&Posix, &src2, &["COMMITTED".into()], CHUNK).unwrap();
        let staging2 = c.staging.with_file_name("peer-2-abc");
        stage(&src2, &staging2, &m2);
        let version2 = c.version.with_file_name("2");
        let out = publish(&staging2, &c.local, &version2, &m2, Some(&keys(&m2))).unwrap();
        assert!(matches!(out, PublishOutcome::Published { .. }), "{out:?}");
        assert!(names(&c.local, &version2));
        assert_eq!(std::fs::read(c.local.join("a.bin")).unwrap(), b"new bytes");
        // The older version is untouched where the reader was sent.
        assert_eq!(std::fs::read(&leased).unwrap(), old_bytes);
        assert!(matches(&c.version, &c.m, &|_| None).unwrap());
        // A crash after the exchange, before its leftover went: finished.
        std::fs::create_dir_all(&staging2).unwrap();
        std::os::unix::fs::symlink("stale", link_aside(&version2)).unwrap();
        std::fs::create_dir_all(held_dir(&staging2)).unwrap();
        let out = publish(&staging2, &c.local, &version2, &m2, None).unwrap();
        assert_eq!(out, PublishOutcome::Recovered);
        assert!(!link_aside(&version2).exists());
        assert!(names(&c.local, &version2));
    }

    #[test]
    fn the_link_is_relative_so_the_sink_root_may_move() {
        let c = case();
        publish(&c.staging, &c.local, &c.version, &c.m, None).unwrap();
        let root = c._tmp.path();
        let moved = root.with_file_name(format!(
            "{}-moved",
            root.file_name().unwrap().to_string_lossy()
        ));
        std::fs::rename(root, &moved).unwrap();
        let bytes = std::fs::read(moved.join("site/job/step_100/a.bin"));
        std::fs::rename(&moved, root).unwrap();
        assert_eq!(bytes.unwrap(), std::fs::read(c.src.join("a.bin")).unwrap());
    }

    #[test]
    fn adopting_a_replica_published_in_place_keeps_its_files_visible() {
        let c = case();
        std::fs::create_dir_all(&c.local).unwrap();
        std::fs::write(c.local.join("a.bin"), b"in place").unwrap();
        assert!(adopt(&c.local, &c.version).unwrap());
        assert!(names(&c.local, &c.version));
        assert_eq!(std::fs::read(c.local.join("a.bin")).unwrap(), b"in place");
        assert_eq!(std::fs::read(c.version.join("a.bin")).unwrap(), b"in place");
        // Once is enough; a link is not adopted again.
        assert!(!adopt(&c.local, &c.version).unwrap());
        // A version directory in the way: refused, nothing moves.
        let other = c._tmp.path().join("site/job/step_200");
        std::fs::create_dir_all(&other).unwrap();
        let err = adopt(&other, &c.version).unwrap_err();
        assert!(err.to_string().contains("exists already"), "{err}");
        assert!(is_real_dir(&other));
    }

    #[test]
    fn a_crash_before_the_catalog_heard_of_it_is_recognised() {
        let c = case();
        let first = publish(&c.staging, &c.local, &c.version, &c.m, Some(&keys(&c.m))).unwrap();
        assert!(
            matches!(first, PublishOutcome::Published { .. }),
            "{first:?}"
        );
        std::fs::create_dir_all(&c.staging).unwrap();
        let out = publish(&c.staging, &c.local, &c.version, &c.m, Some(&keys(&c.m))).unwrap();
        assert_eq!(out, PublishOutcome::Recovered);
        assert_published(&c);
    }

    #[test]
    fn an_interrupted_publish_with_no_verified_copy_is_refused_and_nothing_deleted() {
        let c = case();
        let held = up_to_markers_held(&c);
        // Damage the only copy.
        let a = OpenOptions::new()
            .write(true)
            .open(c.staging.join("a.bin"))
            .unwrap();
        a.write_all_at(&[9], 7).unwrap();
        let m = c.m.clone();
        let err = publish(&c.staging, &c.local, &c.version, &m, Some(&keys(&m))).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("interrupted"), "{text}");
        assert!(text.contains("push the checkpoint again"), "{text}");
        assert!(c.staging.join("a.bin").exists());
        assert!(held.join("0").exists());
        assert!(!c.local.exists());
    }

    #[test]
    fn an_older_version_in_place_is_not_taken_for_the_new_one() {
        let c = case();
        std::fs::create_dir_all(&c.local).unwrap();
        std::fs::write(c.local.join("a.bin"), b"old").unwrap();
        // Staging holds the new version: a normal publish, by exchange.
        let out = publish(&c.staging, &c.local, &c.version, &c.m, Some(&keys(&c.m))).unwrap();
        assert!(
            matches!(
                out,
                PublishOutcome::Published {
                    reread: Some(_),
                    ..
                }
            ),
            "{out:?}"
        );
        assert_published(&c);
    }
}

#[cfg(test)]
mod pool_check {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// On a local file system both checks pass, and nothing is left.
    #[test]
    fn a_local_root_is_ready_for_a_pool_and_the_check_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join(".ferry");
        check_pool_ready(&dir).unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    }

    /// Where the scratch directory cannot be made, the error names it.
    #[test]
    fn a_root_it_cannot_write_is_refused_naming_the_path() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("not-a-dir");
        std::fs::write(&file, b"x").unwrap();
        let e = check_pool_ready(&file).unwrap_err().to_string();
        assert!(e.contains("not-a-dir"), "{e}");
    }
}
