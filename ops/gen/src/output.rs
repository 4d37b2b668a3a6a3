//! Stores that take a checkpoint one whole file at a time: the generator's
//! way into an HDFS directory or an S3 prefix, where there is no rename of
//! an open file, no rewrite in place and (on S3) no append.
//!
//! [`crate::generate_into`] and [`crate::format::save_into`] write into an
//! [`Output`]: each file is created, written from its first byte to its
//! last in pieces of at most 1 MiB (the generator's buffers; the store may
//! keep a bounded part of its own), and finished before the next file is
//! created, so a reader never sees two files in progress. The generator
//! itself never talks to a store: the `ferry` command implements this
//! trait for HDFS and S3, and tests for memory.

use std::io;
use std::path::Path;

/// Largest piece the generator hands to [`OutputFile::write`] (1 MiB).
pub(crate) const PIECE_BYTES: u64 = 1 << 20;

/// Where a save goes, one whole file after another. Paths are relative
/// to the store's root, `/`-separated, never with `.` or `..`.
pub trait Output {
    /// Starts the file at `rel`, replacing any file there; `size` is its
    /// final length in bytes (what the pieces written into it add up to,
    /// or fewer if the save is killed), for stores that plan their writes
    /// by it.
    ///
    /// # Errors
    /// The store's error, naming the file.
    fn create(&self, rel: &Path, size: u64) -> io::Result<Box<dyn OutputFile>>;

    /// Deletes the file at `rel` (NeMo's `-unfinished` marker, removed at
    /// the commit); `Ok` when there is none.
    ///
    /// # Errors
    /// The store's error, naming the file.
    fn remove(&self, rel: &Path) -> io::Result<()>;
}

/// A file of an [`Output`] being written, in order.
pub trait OutputFile {
    /// Appends `bytes`.
    ///
    /// # Errors
    /// The store's error, naming the file.
    fn write(&mut self, bytes: &[u8]) -> io::Result<()>;

    /// Completes the file: when this returns it is whole in the store.
    ///
    /// # Errors
    /// The store's error, naming the file.
    fn finish(self: Box<Self>) -> io::Result<()>;

    /// Gives the file up midway (a killed save): the store leaves what a
    /// killed writer would leave there (HDFS: the bytes written so far;
    /// S3: no object). `Ok(true)` when a file is left.
    ///
    /// # Errors
    /// The store's error, naming the file.
    fn abandon(self: Box<Self>) -> io::Result<bool>;
}

/// A store in memory that checks the [`Output`] contract, for tests.
#[cfg(test)]
#[allow(clippy::unwrap_used, missing_docs)]
pub(crate) mod mem {
    use std::cell::RefCell;
    use std::collections::BTreeMap;
    use std::io;
    use std::path::{Path, PathBuf};
    use std::rc::Rc;

    use super::{Output, OutputFile};

    /// What a memory store saw, in order.
    #[derive(Debug, Clone, PartialEq)]
    pub(crate) enum Seen {
        Create(PathBuf),
        Finish(PathBuf),
        Abandon(PathBuf),
        Remove(PathBuf),
    }

    #[derive(Default)]
    pub(crate) struct Mem {
        pub(crate) seen: Vec<Seen>,
        pub(crate) files: BTreeMap<PathBuf, Vec<u8>>,
        pub(crate) open: Option<PathBuf>,
    }

    #[derive(Default, Clone)]
    pub(crate) struct MemOut(pub(crate) Rc<RefCell<Mem>>);

    struct MemFile {
        mem: MemOut,
        path: PathBuf,
        size: u64,
        bytes: Vec<u8>,
    }

    impl Output for MemOut {
        fn create(&self, rel: &Path, size: u64) -> io::Result<Box<dyn OutputFile>> {
            let mut m = self.0.borrow_mut();
            assert!(rel.is_relative(), "{rel:?}");
            assert_eq!(m.open, None, "{rel:?} created while another is open");
            m.open = Some(rel.to_path_buf());
            m.seen.push(Seen::Create(rel.to_path_buf()));
            Ok(Box::new(MemFile {
                mem: self.clone(),
                path: rel.to_path_buf(),
                size,
                bytes: Vec::new(),
            }))
        }

        fn remove(&self, rel: &Path) -> io::Result<()> {
            let mut m = self.0.borrow_mut();
            m.seen.push(Seen::Remove(rel.to_path_buf()));
            m.files.remove(rel);
            Ok(())
        }
    }

    impl OutputFile for MemFile {
        fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
            assert!(bytes.len() as u64 <= super::PIECE_BYTES);
            self.bytes.extend_from_slice(bytes);
            Ok(())
        }

        fn finish(self: Box<Self>) -> io::Result<()> {
            assert_eq!(self.bytes.len() as u64, self.size, "{:?}", self.path);
            let mut m = self.mem.0.borrow_mut();
            m.open = None;
            m.seen.push(Seen::Finish(self.path.clone()));
            m.files.insert(self.path, self.bytes);
            Ok(())
        }

        fn abandon(self: Box<Self>) -> io::Result<bool> {
            let mut m = self.mem.0.borrow_mut();
            m.open = None;
            m.seen.push(Seen::Abandon(self.path.clone()));
            m.files.insert(self.path, self.bytes);
            Ok(true)
        }
    }
}
