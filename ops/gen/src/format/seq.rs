//! The save of a framework into a store that takes whole files, one after
//! the other ([`save_into`], whose docs give the rules): an HDFS
//! directory, written sequentially, or an S3 prefix, object by object.

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use super::framing::{Crc32, Sink};
use super::layout::{self, Cut, Event, FileJob, Layout, Step, Until};
use super::pace::{self, Throttle};
use super::{path_hash, Fault, SaveOptions, SaveSummary};
use crate::output::{Output, OutputFile};
use crate::{file_seed, SMALL_SHARD_BYTES};

/// Writes the save of `opts` into `out`, one whole file after another,
/// markers last; for [`Fault::ReusedDir`], two saves. Paths are relative
/// to the store's root; `opts.root` only prefixes the paths of the
/// summary (it may be the store's URL). `progress` is called with the
/// bytes written so far, after every piece (at most 1 MiB).
///
/// The plan is [`super::save`]'s, with the same file names and bytes;
/// what changes is how it is run. The ranks take turns in one thread:
/// each turn runs one rank until it has written one file, must wait for
/// another rank, or is done, so the files come in an order the
/// framework's ranks could close them in (every rank's own order, and no
/// file before what its rank waited for). The POSIX tricks become what
/// they mean on such a store:
///
/// - a file written under a temporary name and renamed (safetensors'
///   `.tmpXXXXXX`, DCP's `.metadata.tmp`) is written under its final
///   name;
/// - Orbax's temporary directory is not used: its files go straight into
///   `<N>/`, with `commit_success.txt` last (what Orbax itself does on an
///   object store, where it cannot rename a directory);
/// - a file that a rank holds open across the marker (DeepSpeed's last
///   optimizer shard, the HF Trainer's other RNG states) is finished
///   whole before the marker, so markers come last;
/// - a marker rewritten in place (the stale-marker fault) is written
///   twice, its final content last;
/// - a damaged file (truncated and zero-byte faults) is written cut short;
/// - NeMo's `-unfinished` marker is written first and deleted last;
/// - directories are not made: a store makes them with their files
///   (HDFS) or has none (S3);
/// - a killed save leaves the files finished before the kill point and
///   gives up the one in progress ([`OutputFile::abandon`]); the
///   summary's `dir` is `<N>/` for Orbax too.
///
/// # Errors
/// [`io::ErrorKind::InvalidInput`] for impossible options, as
/// [`super::save`]; the store's errors; "save stopped" once
/// [`SaveOptions::stop`] is set.
pub fn save_into(
    opts: &SaveOptions,
    out: &dyn Output,
    progress: &dyn Fn(u64),
) -> io::Result<SaveSummary> {
    if opts.write_rate_bps == Some(0) {
        return Err(crate::invalid("write_rate_bps must be above 0"));
    }
    let (first, written) = run(opts, opts.seed, out, progress, 0)?;
    if opts.fault != Fault::ReusedDir {
        return Ok(first);
    }
    run(opts, opts.seed.wrapping_add(1), out, progress, written).map(|(s, _)| s)
}

/// What the ranks of a sequential save told each other.
#[derive(Debug, Default)]
struct Board {
    data_closed: u32,
    pending: u32,
    marker_written: bool,
}

impl Board {
    fn post(&mut self, event: Event) {
        match event {
            Event::DataClosed => self.data_closed += 1,
            Event::Pending => self.pending += 1,
            Event::MarkerWritten => self.marker_written = true,
        }
    }

    fn holds(&self, until: Until) -> bool {
        match until {
            Until::DataClosed(n) => self.data_closed >= n,
            Until::Pending(n) => self.pending >= n,
            Until::MarkerWritten => self.marker_written,
        }
    }
}

/// One sequential save in progress.
struct Run<'a> {
    out: &'a dyn Output,
    progress: &'a dyn Fn(u64),
    seed: u64,
    throttle: Throttle,
    board: Board,
    /// Orbax: the temporary directory and the final one.
    staging: Option<(PathBuf, PathBuf)>,
    /// What the damage steps leave of each file.
    cuts: HashMap<PathBuf, Cut>,
    /// Files in the store now, with their sizes.
    files: BTreeMap<PathBuf, u64>,
    /// The commit marker's path in the store.
    marker: PathBuf,
    written: u64,
    tensors: u64,
    small_tensors: u64,
    committed_at: Option<SystemTime>,
    killed: bool,
}

/// Runs one save with `seed`; `written_before` offsets progress. Returns
/// the summary and the bytes written, `written_before` included.
fn run(
    opts: &SaveOptions,
    seed: u64,
    out: &dyn Output,
    progress: &dyn Fn(u64),
    written_before: u64,
) -> io::Result<(SaveSummary, u64)> {
    let layout = layout::build(opts, seed)?;
    let kill_at = (opts.fault == Fault::KillMidSave).then_some(layout.expected_bytes / 2);
    let cuts = layout
        .prelude
        .iter()
        .chain(layout.ranks.iter().flatten())
        .filter_map(|s| match s {
            Step::Damage { path, cut } => Some((path.clone(), *cut)),
            _ => None,
        })
        .collect();
    let mut run = Run {
        out,
        progress,
        seed,
        throttle: Throttle::new(opts.write_rate_bps, kill_at, opts.stop.clone()),
        board: Board::default(),
        staging: layout.staging.clone().map(|s| (s, layout.dir.clone())),
        cuts,
        files: BTreeMap::new(),
        marker: PathBuf::new(),
        written: written_before,
        tensors: 0,
        small_tensors: 0,
        committed_at: None,
        killed: false,
    };
    run.marker = run.target(&layout.marker);
    let opened_at = SystemTime::now();
    run.steps(&layout.prelude)?;
    let mut next = vec![0usize; layout.ranks.len()];
    while !run.killed {
        let mut moved = false;
        let mut done = true;
        for (steps, at) in layout.ranks.iter().zip(&mut next) {
            let before = *at;
            run.turn(steps, at)?;
            moved |= *at != before;
            done &= *at == steps.len();
            if run.killed {
                break;
            }
        }
        if done || run.killed {
            break;
        }
        if !moved {
            return Err(io::Error::other(
                "every rank waits for another (a plan the sequential save cannot run)",
            ));
        }
    }
    // Whatever was finished, killed save or not, is whole when this returns.
    out.barrier()?;
    let summary = run.summary(opts, &layout, opened_at);
    Ok((summary, run.written))
}

impl Run<'_> {
    /// Where file `path` of the plan goes in the store.
    fn target(&self, path: &Path) -> PathBuf {
        match &self.staging {
            Some((tmp, dir)) => match path.strip_prefix(tmp) {
                Ok(rest) => dir.join(rest),
                Err(_) => path.to_path_buf(),
            },
            None => path.to_path_buf(),
        }
    }

    /// Runs the prelude's steps (none of them waits).
    fn steps(&mut self, steps: &[Step]) -> io::Result<()> {
        let mut at = 0;
        while at < steps.len() && !self.killed {
            let before = at;
            self.turn(steps, &mut at)?;
            if at == before {
                return Err(io::Error::other("the prelude of a save waits for a rank"));
            }
        }
        Ok(())
    }

    /// Runs `steps` from `*at` until one file is written, a wait does not
    /// hold yet, or the steps end.
    fn turn(&mut self, steps: &[Step], at: &mut usize) -> io::Result<()> {
        while let Some(step) = steps.get(*at) {
            match step {
                Step::Wait(until) if !self.board.holds(*until) => return Ok(()),
                Step::Wait(_) | Step::Mkdir(_) | Step::RenameDir { .. } => {}
                // Applied when the file was written.
                Step::Damage { .. } => {}
                Step::Post(event) => {
                    // What a rank tells the others it has closed is whole.
                    self.out.barrier()?;
                    self.board.post(*event);
                }
                Step::Commit => {
                    self.out.barrier()?;
                    self.committed_at = Some(SystemTime::now());
                }
                Step::Remove(path) => {
                    let target = self.target(path);
                    self.out.barrier()?;
                    self.out.remove(&target)?;
                    self.files.remove(&target);
                }
                Step::Write(job) => {
                    self.write(job)?;
                    *at += 1;
                    return Ok(());
                }
            }
            *at += 1;
        }
        Ok(())
    }

    /// Writes one file whole (cut short if a fault damages it).
    fn write(&mut self, job: &FileJob) -> io::Result<()> {
        let target = self.target(&job.path);
        let keep = match self.cuts.get(&job.path) {
            Some(Cut::Half) => job.size / 2,
            Some(Cut::Zero) => 0,
            None => job.size,
        };
        if target == self.marker || self.files.contains_key(&target) {
            // A marker comes after every file it commits is whole; a file
            // written again, after its first version is.
            self.out.barrier()?;
        }
        let rng = SmallRng::seed_from_u64(file_seed(self.seed, path_hash(&job.path)));
        let file = self.out.create(&target, keep)?;
        let mut sink = SeqOut {
            run: self,
            file: Some(file),
            rng,
            pos: 0,
            keep,
            kept: 0,
            buf: Vec::new(),
        };
        let result = layout::write_content(&mut sink, &job.content, job.hold);
        let (file, kept) = (sink.file.take(), sink.kept);
        let Some(file) = file else {
            return Ok(());
        };
        match result {
            Ok(()) => {
                file.finish()?;
                self.files.insert(target, kept);
                Ok(())
            }
            Err(e) if pace::is_killed(&e) => {
                self.killed = true;
                if file.abandon()? {
                    self.files.insert(target, kept);
                }
                Ok(())
            }
            Err(e) => {
                // The save fails; what the store keeps of this file is
                // what a killed writer leaves.
                let _ = file.abandon();
                Err(e)
            }
        }
    }

    fn summary(&self, opts: &SaveOptions, layout: &Layout, opened_at: SystemTime) -> SaveSummary {
        SaveSummary {
            // Never a temporary directory: Orbax's files go to `<N>/`.
            dir: opts.root.join(&layout.dir),
            files: self.files.len() as u64,
            bytes: self.files.values().sum(),
            tensors: self.tensors,
            small_tensors: self.small_tensors,
            opened_at,
            committed_at: if self.killed { None } else { self.committed_at },
            marker: opts.root.join(self.target(&layout.marker)),
            damaged: layout
                .damaged
                .as_ref()
                .map(|p| opts.root.join(self.target(p))),
        }
    }
}

/// The file being written: every piece is admitted by the throttle
/// (paced; refused past a kill point), written up to the length the
/// file keeps, and reported as progress.
struct SeqOut<'r, 'a> {
    run: &'r mut Run<'a>,
    file: Option<Box<dyn OutputFile>>,
    rng: SmallRng,
    pos: u64,
    /// Bytes the file keeps (less than its content when damaged).
    keep: u64,
    /// Bytes written into the file so far.
    kept: u64,
    buf: Vec<u8>,
}

impl SeqOut<'_, '_> {
    /// Writes `bytes`, the next of the content, as far as the file keeps.
    fn emit(&mut self, bytes: &[u8]) -> io::Result<()> {
        let room = self.keep.saturating_sub(self.pos);
        let n = (bytes.len() as u64).min(room) as usize;
        if n > 0 {
            if let Some(f) = self.file.as_mut() {
                f.write(&bytes[..n])?;
            }
            self.kept += n as u64;
        }
        self.pos += bytes.len() as u64;
        self.run.written += bytes.len() as u64;
        (self.run.progress)(self.run.written);
        Ok(())
    }
}

impl Sink for SeqOut<'_, '_> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        let mut rest = bytes;
        while !rest.is_empty() {
            let n = self.run.throttle.admit(rest.len() as u64)? as usize;
            self.emit(&rest[..n])?;
            rest = &rest[n..];
        }
        Ok(())
    }

    fn put_random(&mut self, n: u64, mut crc: Option<&mut Crc32>) -> io::Result<()> {
        let mut left = n;
        let mut buf = std::mem::take(&mut self.buf);
        while left > 0 {
            let k = self.run.throttle.admit(left)? as usize;
            if buf.len() < k {
                buf.resize(k, 0);
            }
            let chunk = &mut buf[..k];
            self.rng.fill_bytes(chunk);
            if let Some(c) = crc.as_mut() {
                c.update(chunk);
            }
            self.emit(chunk)?;
            left -= k as u64;
        }
        self.buf = buf;
        Ok(())
    }

    fn pos(&self) -> u64 {
        self.pos
    }

    fn tensor_done(&mut self, bytes: u64) {
        self.run.tensors += 1;
        if bytes < SMALL_SHARD_BYTES {
            self.run.small_tensors += 1;
        }
    }

    fn hold(&mut self) -> io::Result<()> {
        // The rank would keep the file open until the marker is written;
        // here it is finished first, and the marker's writer, waiting for
        // this, may go on.
        self.run.board.post(Event::Pending);
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::fs;

    use super::super::{save_traced, GenFormat, OpKind};
    use super::*;
    use crate::output::mem::{Mem, MemOut, Seen};

    /// Every regular file under `root`, relative, with its bytes.
    fn tree(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
        let mut out = BTreeMap::new();
        let mut stack = vec![root.to_path_buf()];
        while let Some(d) = stack.pop() {
            for entry in fs::read_dir(&d).unwrap() {
                let entry = entry.unwrap();
                if entry.file_type().unwrap().is_dir() {
                    stack.push(entry.path());
                } else {
                    let rel = entry.path().strip_prefix(root).unwrap().to_path_buf();
                    out.insert(rel, fs::read(entry.path()).unwrap());
                }
            }
        }
        out
    }

    fn opts(root: &Path, format: GenFormat, fault: Fault, ranks: u32) -> SaveOptions {
        SaveOptions {
            ranks,
            fault,
            seed: 5,
            ..SaveOptions::new(root, format, 3_000_000)
        }
    }

    /// The POSIX save of `o` (into a new directory) and the sequential
    /// one: the local tree, the POSIX summary and trace, and the store.
    fn both(
        o: &SaveOptions,
    ) -> (
        BTreeMap<PathBuf, Vec<u8>>,
        SaveSummary,
        Vec<super::super::Op>,
        Mem,
        SaveSummary,
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let local = SaveOptions {
            root: tmp.path().join("root"),
            ..o.clone()
        };
        let (summary, trace) = save_traced(&local, &|_| {}).unwrap();
        let out = MemOut::default();
        let last = std::cell::Cell::new(0);
        let seq = save_into(o, &out, &|n| {
            assert!(n >= last.get());
            last.set(n);
        })
        .unwrap();
        let mem = std::mem::take(&mut *out.0.borrow_mut());
        (tree(&local.root), summary, trace, mem, seq)
    }

    /// The files a POSIX trace completes under their final names, in
    /// order (a file closed or renamed into place; Orbax's files as they
    /// are after the directory rename).
    fn posix_order(o: &SaveOptions, trace: &[super::super::Op]) -> Vec<PathBuf> {
        let layout = layout::build(o, o.seed).unwrap();
        let target = |p: &Path| match &layout.staging {
            Some(tmp) => p
                .strip_prefix(tmp)
                .map_or_else(|_| p.to_path_buf(), |r| layout.dir.join(r)),
            None => p.to_path_buf(),
        };
        let names: Vec<PathBuf> = layout
            .prelude
            .iter()
            .chain(layout.ranks.iter().flatten())
            .filter_map(|s| match s {
                Step::Write(job) => Some(target(&job.path)),
                _ => None,
            })
            .collect();
        let mut order: Vec<PathBuf> = Vec::new();
        for op in trace {
            let p = match &op.kind {
                OpKind::Close => target(&op.path),
                OpKind::Rename(to) => target(to),
                _ => continue,
            };
            if names.contains(&p) && order.last() != Some(&p) {
                order.push(p);
            }
        }
        order
    }

    fn finished(mem: &Mem) -> Vec<PathBuf> {
        mem.seen
            .iter()
            .filter_map(|s| match s {
                Seen::Finish(p) => Some(p.clone()),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn save_into_writes_the_posix_bytes_in_the_posix_order_markers_last() {
        for format in GenFormat::ALL {
            for ranks in [1, 3] {
                let o = opts(Path::new("hdfs://nn:8020/ckpt"), format, Fault::None, ranks);
                let (local, posix, trace, mem, seq) = both(&o);
                assert_eq!(
                    mem.files.keys().collect::<Vec<_>>(),
                    local.keys().collect::<Vec<_>>(),
                    "{format} x{ranks}: the file set"
                );
                assert!(mem.files == local, "{format} x{ranks}: the bytes");
                // Each file is whole before the next starts.
                for pair in mem.seen.chunks(2) {
                    match pair {
                        [Seen::Create(a), Seen::Finish(b)] => assert_eq!(a, b),
                        [Seen::Remove(_), ..] | [Seen::Create(_)] => {}
                        other => panic!("{format} x{ranks}: {other:?}"),
                    }
                }
                let marker = seq.marker.strip_prefix(&o.root).unwrap().to_path_buf();
                let last = mem.seen.last().unwrap();
                if format == GenFormat::Nemo {
                    assert!(
                        matches!(last, Seen::Remove(p) if p.to_string_lossy().ends_with("-unfinished")),
                        "{format}: {last:?}"
                    );
                } else {
                    assert_eq!(
                        last,
                        &Seen::Finish(marker.clone()),
                        "{format} x{ranks}: the marker last"
                    );
                }
                if ranks == 1 {
                    let order = posix_order(&o, &trace);
                    assert!(order.len() >= 2, "{format}: {order:?}");
                    assert_eq!(finished(&mem), order, "{format}: the order");
                }
                assert_eq!(
                    (seq.files, seq.bytes),
                    (posix.files, posix.bytes),
                    "{format} x{ranks}"
                );
                assert_eq!(
                    (seq.tensors, seq.small_tensors),
                    (posix.tensors, posix.small_tensors)
                );
                assert!(seq.committed_at.is_some());
                assert_eq!(seq.dir, o.checkpoint_dir());
            }
        }
    }

    #[test]
    fn save_into_a_store_completing_files_together_has_them_whole_before_each_marker() {
        for format in GenFormat::ALL {
            for (ranks, fault) in [(1, Fault::None), (3, Fault::None), (2, Fault::StaleMarker)] {
                if fault == Fault::StaleMarker
                    && layout::build(&opts(Path::new("/r"), format, fault, ranks), 5).is_err()
                {
                    continue;
                }
                let o = opts(Path::new("hdfs://nn:8020/ckpt"), format, fault, ranks);
                let (local, _, _, _, _) = both(&o);
                let out = MemOut::deferred();
                let seq = save_into(&o, &out, &|_| {}).unwrap();
                let mem = out.0.borrow();
                let marker = seq.marker.strip_prefix(&o.root).unwrap().to_path_buf();
                assert_eq!(
                    crate::output::mem::unbarriered(&mem.seen, |p| p == marker),
                    None,
                    "{format} x{ranks} {fault}"
                );
                assert!(mem.pending.is_empty(), "{format} x{ranks} {fault}");
                assert!(mem.files == local, "{format} x{ranks} {fault}: the bytes");
                // Barriers come at the save's few ordering points (each
                // rank's post, the commit, the markers), not after each file.
                let mut filled = 0;
                let mut since = 0;
                for s in &mem.seen {
                    match s {
                        Seen::Finish(_) => since += 1,
                        Seen::Barrier if since > 0 => {
                            filled += 1;
                            since = 0;
                        }
                        _ => {}
                    }
                }
                assert!(
                    filled <= ranks as usize + 4,
                    "{format} x{ranks} {fault}: {filled} barriers completed files, of {} files",
                    finished(&mem).len()
                );
            }
        }
    }

    #[test]
    fn save_into_shows_each_fault_as_the_store_can() {
        for fault in [
            Fault::Truncated,
            Fault::ZeroByte,
            Fault::StaleMarker,
            Fault::ReusedDir,
        ] {
            for format in [
                GenFormat::Dcp,
                GenFormat::DeepSpeed,
                GenFormat::Hf,
                GenFormat::MegatronLegacy,
            ] {
                let o = opts(Path::new("s3://b/p"), format, fault, 2);
                let (local, _, _, mem, seq) = both(&o);
                assert!(mem.files == local, "{format} {fault}: the bytes");
                let marker = seq.marker.strip_prefix(&o.root).unwrap().to_path_buf();
                assert_eq!(
                    mem.seen.last(),
                    Some(&Seen::Finish(marker.clone())),
                    "{format} {fault}"
                );
                if fault == Fault::StaleMarker {
                    // The stale marker first, the real one last.
                    assert_eq!(mem.seen.get(1), Some(&Seen::Finish(marker)), "{format}");
                }
                if let Some(d) = &seq.damaged {
                    let d = d.strip_prefix(&o.root).unwrap();
                    assert!(mem.files.contains_key(d), "{format} {fault}: {d:?}");
                }
            }
        }
    }

    #[test]
    fn save_into_killed_leaves_no_marker_and_about_half_the_bytes() {
        for format in [
            GenFormat::Dcp,
            GenFormat::Hf,
            GenFormat::Nemo,
            GenFormat::Orbax,
        ] {
            let o = opts(Path::new("/r"), format, Fault::KillMidSave, 2);
            let out = MemOut::default();
            let s = save_into(&o, &out, &|_| {}).unwrap();
            let mem = out.0.borrow();
            assert_eq!(s.committed_at, None, "{format}");
            let marker = s.marker.strip_prefix(&o.root).unwrap();
            if format == GenFormat::Nemo {
                assert!(!mem.seen.iter().any(|e| matches!(e, Seen::Remove(_))));
            } else {
                assert!(!mem.files.contains_key(marker), "{format}");
            }
            assert!(
                matches!(mem.seen.last(), Some(Seen::Abandon(_))),
                "{format}: {:?}",
                mem.seen.last()
            );
            let expected = layout::build(&o, o.seed).unwrap().expected_bytes;
            let kept: u64 = mem.files.values().map(|b| b.len() as u64).sum();
            assert!(
                kept.abs_diff(expected / 2) < 1000,
                "{format}: {kept} of {expected}"
            );
            assert_eq!((s.files, s.bytes), (mem.files.len() as u64, kept));
        }
    }

    #[test]
    fn save_into_stops_on_the_stop_flag() {
        let o = opts(Path::new("/r"), GenFormat::Dcp, Fault::None, 2);
        o.stop.stop();
        let out = MemOut::default();
        let e = save_into(&o, &out, &|_| {}).unwrap_err();
        assert!(e.to_string().contains("save stopped"), "{e}");
        assert!(out.0.borrow().open.is_none());
    }
}
