//! Stores that take a checkpoint one whole file at a time: the generator's
//! way into an HDFS directory or an S3 prefix, where there is no rename of
//! an open file, no rewrite in place and (on S3) no append.
//!
//! [`crate::generate_into`] and [`crate::format::save_into`] write into an
//! [`Output`]: each file is created, written from its first byte to its
//! last in pieces of at most 1 MiB (the generator's buffers; the store may
//! keep a bounded part of its own), and finished before the next file is
//! created. A store may complete finished files together (HDFS, where a
//! close waits for the NameNode): the generator calls [`Output::barrier`]
//! wherever the save's order matters (before a commit marker, a removal,
//! a rank telling another it is done, a file written again, and at the
//! end), so a reader never sees a marker before the files it commits. The generator
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

    /// Returns once every file finished so far is whole in the store.
    /// Stores whose [`OutputFile::finish`] completes the file before it
    /// returns do nothing, the default.
    ///
    /// # Errors
    /// The store's error, naming the first file that could not be
    /// completed.
    fn barrier(&self) -> io::Result<()> {
        Ok(())
    }
}

/// A file of an [`Output`] being written, in order.
pub trait OutputFile {
    /// Appends `bytes`.
    ///
    /// # Errors
    /// The store's error, naming the file.
    fn write(&mut self, bytes: &[u8]) -> io::Result<()>;

    /// Completes the file: it is whole in the store when this returns or,
    /// for a store that completes files together, when the next
    /// [`Output::barrier`] returns.
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
        Barrier,
    }

    #[derive(Default)]
    pub(crate) struct Mem {
        pub(crate) seen: Vec<Seen>,
        pub(crate) files: BTreeMap<PathBuf, Vec<u8>>,
        pub(crate) open: Option<PathBuf>,
        /// Completes finished files only at a barrier (as HDFS does).
        pub(crate) deferred: bool,
        /// Files finished since the last barrier (deferred mode).
        pub(crate) pending: Vec<(PathBuf, Vec<u8>)>,
    }

    #[derive(Default, Clone)]
    pub(crate) struct MemOut(pub(crate) Rc<RefCell<Mem>>);

    impl MemOut {
        /// A store that completes finished files only at a barrier.
        pub(crate) fn deferred() -> MemOut {
            let out = MemOut::default();
            out.0.borrow_mut().deferred = true;
            out
        }
    }

    /// The first marker created (`is_marker`) or file removed while a
    /// finished file was not yet completed by a barrier, as "what: the
    /// files"; `None` when there is none.
    pub(crate) fn unbarriered(seen: &[Seen], is_marker: impl Fn(&Path) -> bool) -> Option<String> {
        let mut pending = Vec::new();
        for s in seen {
            match s {
                Seen::Finish(p) => pending.push(p.clone()),
                Seen::Barrier => pending.clear(),
                Seen::Create(p) if is_marker(p) && !pending.is_empty() => {
                    return Some(format!("marker {p:?} before {pending:?} were whole"));
                }
                Seen::Remove(p) if !pending.is_empty() => {
                    return Some(format!("{p:?} removed before {pending:?} were whole"));
                }
                _ => {}
            }
        }
        None
    }

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
            assert!(
                !m.pending.iter().any(|(p, _)| p == rel),
                "{rel:?} created again before a barrier completed it"
            );
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

        fn barrier(&self) -> io::Result<()> {
            let mut m = self.0.borrow_mut();
            if m.deferred {
                m.seen.push(Seen::Barrier);
                for (p, b) in std::mem::take(&mut m.pending) {
                    m.files.insert(p, b);
                }
            }
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
            if m.deferred {
                m.pending.push((self.path, self.bytes));
            } else {
                m.files.insert(self.path, self.bytes);
            }
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
