//! Listing and hashing a checkpoint directory on a local file system: the
//! file list with sizes, modes and mtimes, and every chunk read once and
//! hashed with BLAKE3.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use ferry_proto::manifest::FileInfo;
use ferry_proto::paths::is_temporary;

use super::version_of;
use crate::storage::{FileVersion, ScanError};

/// How to list a checkpoint directory.
#[derive(Debug, Clone, Default)]
pub struct ScanOptions {
    /// File names (not paths) that are commit markers; they go last, in
    /// this order, and are published last.
    pub markers: Vec<String>,
}

/// Result of [`scan`]: the files to send and which are markers.
#[derive(Debug, Clone)]
pub struct Scan {
    /// Files in transfer order: non-markers sorted by path, then markers.
    pub files: Vec<FileInfo>,
    /// The version token of each of `files`, in the same order.
    pub versions: Vec<FileVersion>,
    /// Indices of markers in `files`, in publish order.
    pub markers: Vec<u32>,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ScanError + '_ {
    move |source| ScanError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Lists the regular files under `dir` (recursively, without following
/// symlinks), skipping temporaries ([`is_temporary`]).
///
/// # Errors
/// [`ScanError`] naming the path that could not be read, or a symlink or
/// special file inside the checkpoint (refused rather than silently
/// skipped, since the replica would differ).
pub fn scan(dir: &Path, opts: &ScanOptions) -> Result<Scan, ScanError> {
    let mut files = Vec::new();
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let abs = dir.join(&rel);
        for entry in std::fs::read_dir(&abs).map_err(io_err(&abs))? {
            let entry = entry.map_err(io_err(&abs))?;
            let name = entry.file_name();
            let Some(name_str) = name.to_str() else {
                return Err(ScanError::Unsupported {
                    path: entry.path(),
                    why: "file name is not UTF-8".into(),
                });
            };
            if is_temporary(name_str) {
                continue;
            }
            let rel_child = rel.join(name_str);
            let ft = entry.file_type().map_err(io_err(&entry.path()))?;
            if ft.is_dir() {
                stack.push(rel_child);
            } else if ft.is_file() {
                let md = entry.metadata().map_err(io_err(&entry.path()))?;
                let path = rel_child.to_string_lossy().into_owned();
                files.push((
                    FileInfo {
                        path,
                        size: md.len(),
                        mode: md.permissions().mode() & 0o7777,
                        mtime_ns: md.mtime() * 1_000_000_000 + md.mtime_nsec(),
                    },
                    version_of(&md),
                ));
            } else {
                return Err(ScanError::Unsupported {
                    path: entry.path(),
                    why: "symlinks and special files are not replicated".into(),
                });
            }
        }
    }
    let marker_rank = |p: &str| {
        let name = p.rsplit('/').next().unwrap_or(p);
        opts.markers.iter().position(|m| m == name)
    };
    files.sort_by(|(a, _), (b, _)| {
        let ka = (marker_rank(&a.path).map_or(0, |r| r + 1), &a.path);
        let kb = (marker_rank(&b.path).map_or(0, |r| r + 1), &b.path);
        ka.cmp(&kb)
    });
    let markers = files
        .iter()
        .enumerate()
        .filter(|(_, (f, _))| marker_rank(&f.path).is_some())
        .map(|(i, _)| i as u32)
        .collect();
    let (files, versions) = files.into_iter().unzip();
    Ok(Scan {
        files,
        versions,
        markers,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use ferry_proto::manifest::{Manifest, MIN_CHUNK_SIZE};

    use crate::storage::build;
    use crate::storage::posix::Posix;

    use super::*;

    fn write(dir: &Path, rel: &str, len: usize) {
        let p = dir.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, (0..len).map(|i| (i * 7 % 251) as u8).collect::<Vec<_>>()).unwrap();
    }

    #[test]
    fn scan_orders_markers_last_and_skips_temporaries() {
        let d = tempfile::tempdir().unwrap();
        write(d.path(), ".metadata", 10);
        write(d.path(), "__0_0.distcp", 100);
        write(d.path(), "sub/b", 3);
        write(d.path(), ".metadata.tmp", 5);
        write(d.path(), "COMMITTED", 0);
        let s = scan(
            d.path(),
            &ScanOptions {
                markers: vec![".metadata".into(), "COMMITTED".into()],
            },
        )
        .unwrap();
        let names: Vec<_> = s.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(names, ["__0_0.distcp", "sub/b", ".metadata", "COMMITTED"]);
        assert_eq!(s.markers, [2, 3]);
    }

    #[test]
    fn chunk_hashes_match_blake3_of_each_range() {
        let d = tempfile::tempdir().unwrap();
        let cs = MIN_CHUNK_SIZE;
        write(d.path(), "big", cs as usize * 2 + 17);
        write(d.path(), "empty", 0);
        let m = build(&Posix, d.path(), &[], cs).unwrap();
        let data = std::fs::read(d.path().join("big")).unwrap();
        let big = &m.files[0];
        assert_eq!(big.chunks.len(), 3);
        assert_eq!(
            big.chunks[2],
            *blake3::hash(&data[2 * cs as usize..]).as_bytes()
        );
        assert!(m.files[1].chunks.is_empty());
        let again = Manifest::decode(&m.encode()).unwrap();
        assert_eq!(again.root(), m.root());
        // Any change to the content changes the root.
        write(d.path(), "empty", 1);
        assert_ne!(build(&Posix, d.path(), &[], cs).unwrap().root(), m.root());
    }
}
