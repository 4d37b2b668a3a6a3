//! A [`SourceStore`] over the local file system and any number of remote
//! roots, so that a source can hold roots of each kind and name every
//! checkpoint by one path: a local path, or the URL of a file under a
//! remote root (`hdfs://nn:8020/ckpt/job/step-100/x.distcp`,
//! `s3://bucket/ckpt/job/step-100/x.distcp`). A URL goes to its root's
//! store as the path part (`/ckpt/job/step-100/x.distcp`); every other
//! path to [`Posix`].

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::posix::Posix;
use super::remote::RemoteRoot;
use super::{FileVersion, Listing, RangeRead, ScanError, SourceStore, Watch, WatchHandler};

/// Whether `p` is written as a URL (`scheme://...`) rather than a path.
pub fn is_url(p: &Path) -> bool {
    p.to_str().is_some_and(|s| s.contains("://"))
}

/// Opens the store of remote root `url` (`hdfs://namenode:port/dir`, or
/// `s3://bucket/prefix` with `s3`'s endpoint and credentials) for reading
/// checkpoints, checking that the NameNode or endpoint answers, the
/// credentials are accepted and the bucket exists. The root directory
/// itself need not exist yet (as a local root, it is watched until it
/// does); [`Router`] sends it only paths under the root.
///
/// # Errors
/// A URL that does not parse; the server's error (unreachable, refused
/// credentials, missing bucket), naming the URL.
pub fn open_remote(
    url: &str,
    s3: &super::s3::S3Config,
) -> io::Result<(RemoteRoot, Arc<dyn SourceStore>)> {
    let root = RemoteRoot::parse(url)?;
    let store_url = format!("{}://{}", root.scheme, root.authority);
    let named = |e: io::Error| io::Error::new(e.kind(), format!("{url}: {e}"));
    let store: Arc<dyn SourceStore> = if root.scheme == "hdfs" {
        Arc::new(super::hdfs::Hdfs::connect(&store_url, None).map_err(named)?)
    } else {
        Arc::new(super::s3::S3::connect(&store_url, s3).map_err(named)?)
    };
    Ok((root, store))
}

/// The local file system plus remote roots, by URL.
#[derive(Debug, Default)]
pub struct Router {
    /// Each remote root and its store.
    remotes: Vec<(RemoteRoot, Arc<dyn SourceStore>)>,
}

impl Router {
    /// A router of the local file system only.
    pub fn new() -> Router {
        Router::default()
    }

    /// Adds remote root `root`, served by `store` (opened at that root).
    pub fn add(&mut self, root: RemoteRoot, store: Arc<dyn SourceStore>) {
        self.remotes.push((root, store));
    }

    /// The store of `p` and the path to give it.
    ///
    /// # Errors
    /// `InvalidInput` for a URL under none of the remote roots, naming it.
    fn route<'a>(&'a self, p: &'a Path) -> io::Result<(&'a dyn SourceStore, PathBuf)> {
        let Some(s) = p.to_str().filter(|s| s.contains("://")) else {
            return Ok((&Posix, p.to_path_buf()));
        };
        let (scheme, rest) = s.split_once("://").unwrap_or(("", s));
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let path = PathBuf::from(format!("/{path}"));
        self.remotes
            .iter()
            .filter(|(r, _)| r.scheme == scheme && r.authority == authority)
            .filter(|(r, _)| path.starts_with(&r.path))
            .max_by_key(|(r, _)| r.path.as_os_str().len())
            .map(|(_, store)| (&**store, path))
            .ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{s}: not under any configured source root"),
                )
            })
    }
}

impl SourceStore for Router {
    fn watch(&self, root: &Path, on_event: WatchHandler) -> io::Result<Option<Box<dyn Watch>>> {
        let (store, p) = self.route(root)?;
        store.watch(&p, on_event)
    }

    fn list(&self, dir: &Path, markers: &[String]) -> Result<Listing, ScanError> {
        let (store, p) = self.route(dir).map_err(|source| ScanError::Io {
            path: dir.to_path_buf(),
            source,
        })?;
        store.list(&p, markers)
    }

    fn open(&self, path: &Path) -> io::Result<Box<dyn RangeRead>> {
        let (store, p) = self.route(path)?;
        store.open(&p)
    }

    fn stat(&self, path: &Path) -> io::Result<(u64, i64, FileVersion)> {
        let (store, p) = self.route(path)?;
        store.stat(&p)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn urls_go_to_their_root_and_paths_stay_local() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("f"), b"abc").unwrap();
        let mut r = Router::new();
        let root = RemoteRoot::parse("s3://bucket/ckpt").unwrap();
        // A store that is never called: routing is what is tested.
        r.add(root, Arc::new(Posix));
        assert_eq!(r.stat(&d.path().join("f")).unwrap().0, 3, "local");
        let (_, p) = r.route(Path::new("s3://bucket/ckpt/job/x")).unwrap();
        assert_eq!(p, Path::new("/ckpt/job/x"));
        for bad in [
            "s3://bucket/other/x",
            "s3://other/ckpt/x",
            "hdfs://bucket/ckpt/x",
        ] {
            let e = r.route(Path::new(bad)).err().unwrap().to_string();
            assert!(e.contains(bad) && e.contains("not under"), "{e}");
        }
        assert!(is_url(Path::new("hdfs://nn/x")) && !is_url(Path::new("/x")));
    }
}
