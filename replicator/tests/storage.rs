//! Conformance suite of the storage seams: what the source and the sink
//! rely on, written once against the traits and run for every backend:
//! POSIX, HDFS (a MiniDFSCluster) and S3 (SeaweedFS). The servers are
//! started by `ops/test` (through `ops/with-test-servers`), which passes
//! their addresses in FERRY_TEST_HDFS_URL, FERRY_TEST_S3_URL and the S3
//! key pair in FERRY_TEST_S3_ACCESS_KEY_ID / FERRY_TEST_S3_SECRET_ACCESS_KEY.
//! Each test works under a directory or key prefix of its own.
#![allow(clippy::unwrap_used)]

use std::io;
use std::path::{Path, PathBuf};

use ferry_proto::manifest::{Manifest, MIN_CHUNK_SIZE};
use replicator::storage::hdfs::Hdfs;
use replicator::storage::posix::Posix;
use replicator::storage::s3::{S3Config, MIN_PART, S3};
use replicator::storage::{build, PublishOutcome, SinkStore, SourceStore, WatchEvent};

/// Writes a whole file (or object) of a backend, as a checkpoint writer
/// would.
type Put<'a> = &'a (dyn Fn(&Path, &[u8]) -> io::Result<()> + Sync);
/// Creates a file only if none is there: `Ok(true)` if this call did.
type PutIfAbsent<'a> = &'a (dyn Fn(&Path, &[u8]) -> io::Result<bool> + Sync);

/// One backend under test.
struct Backend<'a> {
    src: &'a dyn SourceStore,
    sink: &'a dyn SinkStore,
    put: Put<'a>,
    put_if_absent: PutIfAbsent<'a>,
    /// Whether a replica read back keeps the modes and mtimes of the
    /// manifest (an object store keeps them in its commit object instead).
    keeps_metadata: bool,
    /// Whether [`SinkStore::withdraw`] moves a version aside for `retire`
    /// to delete; false where objects cannot move (S3), and withdrawing
    /// deletes the version itself.
    moves_aside: bool,
    /// How a re-save shares an unchanged file with the published version:
    /// "link" (POSIX: a hard link), "in place" (S3: the published object
    /// is kept, not copied), "copy" (HDFS).
    shares: &'static str,
}

/// What must match between a checkpoint and its replica: the manifest
/// root, or where the store keeps no modes and mtimes, every file's path,
/// size and chunk hashes and the markers.
fn same_replica(b: &Backend, replica: &Manifest, original: &Manifest) {
    if b.keeps_metadata {
        assert_eq!(
            replica.root(),
            original.root(),
            "the replica is byte-identical"
        );
    } else {
        let content = |m: &Manifest| {
            let files: Vec<_> = m
                .files
                .iter()
                .map(|f| (f.path.clone(), f.size, f.chunks.clone()))
                .collect();
            (files, m.markers.clone())
        };
        assert_eq!(
            content(replica),
            content(original),
            "the replica is byte-identical"
        );
    }
}

/// `len` patterned bytes.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
}

/// Writes `len` patterned bytes at `rel` under `dir`.
fn write(dir: &Path, rel: &str, len: usize, seed: u8) {
    let p = dir.join(rel);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    let bytes: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect();
    std::fs::write(p, bytes).unwrap();
}

/// Listing: sizes, markers last, temporaries skipped, and a version token
/// that changes when a file is rewritten even with the same size and
/// mtime.
fn lists_with_sizes_markers_and_versions(src: &dyn SourceStore, dir: &Path) {
    write(dir, "b.bin", 1000, 1);
    write(dir, "sub/a.bin", 10, 2);
    write(dir, "x.tmp", 5, 3);
    write(dir, "COMMITTED", 0, 0);
    let l = src.list(dir, &["COMMITTED".into()]).unwrap();
    let names: Vec<_> = l.files.iter().map(|f| f.info.path.as_str()).collect();
    assert_eq!(names, ["b.bin", "sub/a.bin", "COMMITTED"]);
    assert_eq!(l.markers, [2]);
    assert_eq!(l.files[0].info.size, 1000);
    let before = l.files[0].clone();
    // Same size, then the old mtime put back: only the token tells.
    write(dir, "b.bin", 1000, 9);
    let p = dir.join("b.bin");
    let f = std::fs::File::options().write(true).open(&p).unwrap();
    f.set_modified(
        std::time::UNIX_EPOCH + std::time::Duration::from_nanos(before.info.mtime_ns as u64),
    )
    .unwrap();
    drop(f);
    let after = src.list(dir, &["COMMITTED".into()]).unwrap().files[0].clone();
    assert_eq!(
        (after.info.size, after.info.mtime_ns),
        (before.info.size, before.info.mtime_ns)
    );
    assert_ne!(
        after.version, before.version,
        "a rewrite must change the version"
    );
    assert_eq!(src.stat(&p).unwrap().2, after.version);
}

/// Listing on any backend: sizes, mtimes, markers last, temporaries
/// skipped, and a version token that changes when a file is rewritten.
fn lists(b: &Backend, dir: &Path) {
    (b.put)(&dir.join("b.bin"), &pattern(1000, 1)).unwrap();
    (b.put)(&dir.join("sub/a.bin"), &pattern(10, 2)).unwrap();
    (b.put)(&dir.join("x.tmp"), &pattern(5, 3)).unwrap();
    (b.put)(&dir.join("COMMITTED"), &[]).unwrap();
    let l = b.src.list(dir, &["COMMITTED".into()]).unwrap();
    let names: Vec<_> = l.files.iter().map(|f| f.info.path.as_str()).collect();
    assert_eq!(names, ["b.bin", "sub/a.bin", "COMMITTED"]);
    assert_eq!(l.markers, [2]);
    let sizes: Vec<_> = l.files.iter().map(|f| f.info.size).collect();
    assert_eq!(sizes, [1000, 10, 0]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as i64;
    for f in &l.files {
        // Written within the last ten minutes (clocks of one machine).
        assert!(
            (now - f.info.mtime_ns).abs() < 600_000_000_000,
            "mtime of {}: {} (now {now})",
            f.info.path,
            f.info.mtime_ns
        );
    }
    let before = l.files[0].clone();
    assert_eq!(b.src.stat(&dir.join("b.bin")).unwrap().2, before.version);
    // A rewrite with other content of the same size changes the version.
    (b.put)(&dir.join("b.bin"), &pattern(1000, 9)).unwrap();
    let after = b.src.list(dir, &["COMMITTED".into()]).unwrap().files[0].clone();
    assert_eq!(after.info.size, 1000);
    assert_ne!(
        after.version, before.version,
        "a rewrite must change the version"
    );
    assert!(b.src.list(&dir.join("missing"), &[]).is_err());
}

/// Two concurrent conditional creates of one name, 20 rounds: exactly one
/// succeeds each time.
fn conditional_create(b: &Backend, dir: &Path, server: &str) {
    for round in 0..20 {
        let p = dir.join(format!("commit-{round}"));
        let barrier = std::sync::Barrier::new(2);
        let won: Vec<bool> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2u8)
                .map(|i| {
                    let (p, barrier) = (&p, &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        (b.put_if_absent)(p, &[i]).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(
            won.iter().filter(|w| **w).count(),
            1,
            "{server}: round {round}: two concurrent conditional creates of one name, \
             exactly one must succeed; got {won:?}"
        );
    }
}

/// Ranged reads: exact ranges, end of file named, current size.
fn reads_ranges(b: &Backend, dir: &Path) {
    let src = b.src;
    let data = pattern(300, 5);
    (b.put)(&dir.join("r.bin"), &data).unwrap();
    let f = src.open(&dir.join("r.bin")).unwrap();
    let mut buf = [0u8; 100];
    f.read_exact_at(&mut buf, 150).unwrap();
    assert_eq!(&buf[..], &data[150..250]);
    assert_eq!(f.read_range(250, 50).unwrap(), &data[250..300]);
    let e = f.read_range(250, 51).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    assert_eq!(f.current().unwrap().0, 300);
    let e = src.open(&dir.join("missing")).err().unwrap();
    assert_eq!(e.kind(), std::io::ErrorKind::NotFound);
}

/// Staging, sharing, publishing, retiring: a first version published from
/// chunks staged out of order; a second sharing an unchanged file with it
/// (where the backend can; otherwise staged again) and replacing it at
/// the same path; then retired.
fn stages_publishes_and_retires(b: &Backend, dir: &Path) {
    let (src, sink) = (b.src, b.sink);
    let cs = MIN_CHUNK_SIZE;
    let ckpt = dir.join("ckpt");
    let content = |rel: &str| match rel {
        "w.bin" => pattern(cs as usize * 2 + 5, 1),
        "opt/o.bin" => pattern(7, 2),
        _ => Vec::new(),
    };
    for rel in ["w.bin", "opt/o.bin", "COMMITTED"] {
        (b.put)(&ckpt.join(rel), &content(rel)).unwrap();
    }
    let markers = ["COMMITTED".to_string()];
    let m1 = build(src, &ckpt, &markers, cs).unwrap();
    let staging = dir.join("staging-1");
    let local = dir.join("replicas/ckpt");
    {
        let mut st = sink.staging(&staging);
        // Chunks in reverse order, as streams deliver them.
        for f in m1.files.iter().rev() {
            let data = content(&f.path);
            let mut off = data.len();
            while off > 0 {
                let start = (off - 1) / cs as usize * cs as usize;
                st.stage_chunk(&f.path, start as u64, &data[start..off])
                    .unwrap();
                off = start;
            }
            if data.is_empty() {
                st.stage_chunk(&f.path, 0, &[]).unwrap();
            }
        }
    }
    let (v1, v2) = (dir.join("versions/1"), dir.join("versions/2"));
    let out = sink
        .publish(&staging, &local, &v1, &m1, None, None)
        .unwrap();
    assert!(matches!(out, PublishOutcome::Published { .. }), "{out:?}");
    sink.publish_recorded(&staging).unwrap();
    assert!(!sink.publish_under_way(&staging));
    let again = build(src, &local, &markers, cs).unwrap();
    same_replica(b, &again, &m1);

    // Version 2: w.bin unchanged (shared), o.bin rewritten.
    let o2 = pattern(9, 3);
    (b.put)(&ckpt.join("opt/o.bin"), &o2).unwrap();
    let w_before = src.stat(&local.join("w.bin")).unwrap();
    if b.shares == "in place" {
        // S3 times objects to the second: a copy would show as a newer one.
        std::thread::sleep(std::time::Duration::from_millis(1100));
    }
    let m2 = build(src, &ckpt, &markers, cs).unwrap();
    let staging2 = dir.join("staging-2");
    {
        let mut st = sink.staging(&staging2);
        sink.share_unchanged(&local, &staging2, "w.bin").unwrap();
        st.stage_chunk("opt/o.bin", 0, &o2).unwrap();
        st.stage_chunk("COMMITTED", 0, &[]).unwrap();
    }
    let out = sink
        .publish(&staging2, &local, &v2, &m2, None, None)
        .unwrap();
    assert!(matches!(out, PublishOutcome::Published { .. }), "{out:?}");
    sink.publish_recorded(&staging2).unwrap();
    same_replica(b, &build(src, &local, &markers, cs).unwrap(), &m2);
    if b.shares == "in place" {
        // The published object was kept, not written again.
        let w_after = src.stat(&local.join("w.bin")).unwrap();
        assert_eq!(w_after, w_before, "w.bin was copied, not kept");
        // (w.bin is version 1's object, which version 2 names.)
        shared_then_changed_is_fetched_again(b, &content("w.bin"), &local, &v1, dir, &m2);
    }
    if sink.versioned() {
        // The older version stays whole in its own directory (a leased
        // reader's path) until it is withdrawn, which leaves the
        // published path alone.
        assert_eq!(sink.named_version(&local).unwrap().as_deref(), Some(&*v2));
        if b.shares == "copy" {
            // HDFS with versions: readers find the version's directory (the
            // published path is only a pointer file).
            assert_eq!(sink.located_url(&local).unwrap(), sink.url_of(&v2));
            assert_eq!(sink.replica_url(&local, &v2), sink.url_of(&v2));
        }
        same_replica(b, &build(src, &v1, &markers, cs).unwrap(), &m1);
        let aside1 = dir.join("retired/old");
        assert!(sink
            .withdraw(&local, &v1, &aside1, std::slice::from_ref(&v2))
            .unwrap());
        sink.retire(&aside1).unwrap();
        assert!(!sink.exists(&v1).unwrap(), "the older version is gone");
        if b.shares != "in place" {
            assert!(src.list(&v1, &[]).is_err(), "the older version is gone");
        }
        // (On S3, its w.bin stays where version 2 names it.)
        same_replica(b, &build(src, &local, &markers, cs).unwrap(), &m2);
    }

    // A staging area that never got published is discarded without a
    // trace; discarding twice is no error.
    let staging3 = dir.join("staging-3");
    sink.staging(&staging3).stage_chunk("x", 0, b"x").unwrap();
    sink.discard(&staging3).unwrap();
    sink.discard(&staging3).unwrap();
    assert!(src.list(&staging3, &[]).is_err(), "nothing left of staging");

    assert!(sink.free_space(dir).unwrap().is_none_or(|b| b > 0));
    sink.flush(dir).unwrap();
    // Withdrawn in one step (nothing left at the published path), then
    // deleted; both steps may be repeated (a restart finishing them).
    let aside = dir.join("retired/1");
    assert!(sink.exists(&local).unwrap());
    assert!(sink.withdraw(&local, &v2, &aside, &[]).unwrap());
    assert!(
        src.list(&local, &[]).is_err(),
        "withdrawn: nothing left to list at the published path"
    );
    assert!(
        !sink.exists(&local).unwrap(),
        "withdrawn: no replica at the published path"
    );
    if !b.moves_aside {
        // Deleted by the withdrawal itself; a repeat finds nothing.
        assert!(src.list(&aside, &[]).is_err(), "nothing was moved aside");
        assert!(
            !sink.withdraw(&local, &v2, &aside, &[]).unwrap(),
            "withdrawn already"
        );
        sink.retire(&aside).unwrap();
        // Nothing of either version is left, the object version 2 kept
        // from version 1 included.
        assert!(
            src.list(&dir.join("versions"), &[]).is_err(),
            "objects of withdrawn versions are left"
        );
        return;
    }
    assert_eq!(
        build(src, &aside, &markers, cs).unwrap().root(),
        m2.root(),
        "the whole version moved aside"
    );
    assert!(
        !sink.withdraw(&local, &v2, &aside, &[]).unwrap(),
        "withdrawn already"
    );
    sink.retire(&aside).unwrap();
    sink.retire(&aside).unwrap();
    assert!(src.list(&aside, &[]).is_err(), "retired: nothing left");
}

/// A file shared with the published version that changes in the store
/// before the publish (another writer, a damaged object) is not kept: the
/// read-back asks for its chunks again, and without the read-back the
/// publish refuses before anything moves.
fn shared_then_changed_is_fetched_again(
    b: &Backend,
    w: &[u8],
    local: &Path,
    object_of: &Path,
    dir: &Path,
    m: &Manifest,
) {
    let sink = b.sink;
    // Another version than the one published (its marker newer).
    let mut m = m.clone();
    for f in &mut m.files {
        if f.path == "COMMITTED" {
            f.mtime_ns += 1_000_000_000;
        }
    }
    let m = &m;
    let staging = dir.join("staging-changed");
    sink.staging(&staging)
        .stage_chunk("COMMITTED", 0, &[])
        .unwrap();
    sink.share_unchanged(local, &staging, "w.bin").unwrap();
    sink.share_unchanged(local, &staging, "opt/o.bin").unwrap();
    let mut changed = w.to_vec();
    changed[0] ^= 0xff;
    (b.put)(&object_of.join("w.bin"), &changed).unwrap();
    let keys: Vec<(u64, ferry_proto::manifest::Hash)> = m
        .files
        .iter()
        .flat_map(|f| f.chunks.iter().copied())
        .enumerate()
        .map(|(i, h)| (i as u64, h))
        .collect();
    let w_keys: Vec<u64> = {
        let mut first = 0u64;
        let mut out = Vec::new();
        for f in &m.files {
            if f.path == "w.bin" {
                out = (first..first + f.chunks.len() as u64).collect();
            }
            first += f.chunks.len() as u64;
        }
        out
    };
    let v = dir.join("versions/3");
    let e = sink
        .publish(&staging, local, &v, m, None, None)
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
    assert!(e.to_string().contains("w.bin"), "{e}");
    assert!(sink.exists(local).unwrap(), "nothing moved");
    match sink
        .publish(&staging, local, &v, m, Some(&keys), None)
        .unwrap()
    {
        PublishOutcome::Refetch(k) => assert_eq!(k, w_keys),
        other => panic!("the changed shared file should be fetched again: {other:?}"),
    }
    sink.discard(&staging).unwrap();
    (b.put)(&object_of.join("w.bin"), w).unwrap();
}

/// Staging never writes through a symlink planted in the staging area.
fn staging_refuses_symlinks(sink: &dyn SinkStore, dir: &Path) {
    let staging = dir.join("staging-evil");
    std::fs::create_dir_all(&staging).unwrap();
    let outside = dir.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::os::unix::fs::symlink(&outside, staging.join("d")).unwrap();
    let mut st = sink.staging(&staging);
    assert!(st.stage_chunk("d/x", 0, b"no").is_err());
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
}

/// Watching, where the backend can: a close after writing and a rename
/// are reported with their paths.
fn watches_where_it_can(src: &dyn SourceStore, dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let s2 = seen.clone();
    let Some(watch) = src
        .watch(dir, Box::new(move |ev| s2.lock().unwrap().push(ev)))
        .unwrap()
    else {
        return; // this backend rescans instead
    };
    let (tmp, fin) = (dir.join("sub.tmp"), dir.join("sub"));
    std::fs::write(&tmp, b"written").unwrap();
    std::fs::rename(&tmp, &fin).unwrap();
    let want = |evs: &[WatchEvent]| {
        evs.contains(&WatchEvent::ClosedAfterWrite(tmp.clone()))
            && evs.contains(&WatchEvent::Renamed {
                from: tmp.clone(),
                to: fin.clone(),
            })
    };
    // Events arrive on the store's thread: wait for them, at most 10 s.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !want(&seen.lock().unwrap()) && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(want(&seen.lock().unwrap()), "{:?}", seen.lock().unwrap());
    drop(watch);
}

/// A publish with read-back finds a staged chunk that does not match the
/// manifest, asks for it again and publishes nothing; once it is staged
/// again the publish goes through.
fn rereads_before_publishing(b: &Backend, dir: &Path) {
    let cs = MIN_CHUNK_SIZE;
    let data = pattern(cs as usize + 100, 6);
    (b.put)(&dir.join("ckpt/f.bin"), &data).unwrap();
    let m = build(b.src, &dir.join("ckpt"), &[], cs).unwrap();
    let keys: Vec<_> = m.files[0]
        .chunks
        .iter()
        .enumerate()
        .map(|(i, h)| (100 + i as u64, *h))
        .collect();
    let (staging, local) = (dir.join("staging"), dir.join("replica"));
    let mut bad = data[..cs as usize].to_vec();
    bad[7] ^= 1;
    {
        let mut st = b.sink.staging(&staging);
        st.stage_chunk("f.bin", 0, &bad).unwrap();
        st.stage_chunk("f.bin", u64::from(cs), &data[cs as usize..])
            .unwrap();
    }
    let out = b
        .sink
        .publish(
            &staging,
            &local,
            &dir.join("versions/1"),
            &m,
            Some(&keys),
            None,
        )
        .unwrap();
    assert_eq!(out, PublishOutcome::Refetch(vec![100]));
    assert!(b.src.list(&local, &[]).is_err(), "nothing published");
    b.sink
        .staging(&staging)
        .stage_chunk("f.bin", 0, &data[..cs as usize])
        .unwrap();
    let out = b
        .sink
        .publish(
            &staging,
            &local,
            &dir.join("versions/1"),
            &m,
            Some(&keys),
            None,
        )
        .unwrap();
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
    let f = b.src.open(&local.join("f.bin")).unwrap();
    assert_eq!(f.read_range(0, data.len() as u64).unwrap(), data);
}

/// The suite every backend passes.
/// The small files beside a replica (DeepSpeed's `latest`): absent, then
/// written, then replaced whole; `exists` sees them.
fn small_files(b: &Backend, dir: &Path) {
    let marker = dir.join("latest");
    assert!(!b.sink.exists(&marker).unwrap());
    assert_eq!(b.sink.read_small(&marker).unwrap(), None);
    b.sink.replace_small(&marker, b"global_step10").unwrap();
    assert!(b.sink.exists(&marker).unwrap());
    assert_eq!(
        b.sink.read_small(&marker).unwrap().as_deref(),
        Some(&b"global_step10"[..])
    );
    b.sink.replace_small(&marker, b"global_step200").unwrap();
    assert_eq!(
        b.sink.read_small(&marker).unwrap().as_deref(),
        Some(&b"global_step200"[..]),
        "replaced whole"
    );
    let listed = b.src.list(dir, &[]).unwrap();
    let names: Vec<_> = listed.files.iter().map(|f| f.info.path.as_str()).collect();
    assert_eq!(names, ["latest"], "no temporary left beside it");
}

/// Many files staged in one staging area, in order within each file but
/// in turns across files (the first chunk of each, then the second of
/// each), with more small files than HDFS keeps closes pending: finished,
/// published and read back whole.
fn stages_files_in_turns(b: &Backend, dir: &Path) {
    let cs = MIN_CHUNK_SIZE as usize;
    let ckpt = dir.join("ckpt");
    let big = |i: u8| pattern(cs * 2 + usize::from(i), 10 + i);
    let small = |i: u8| pattern(1 + usize::from(i), i);
    let bigs: Vec<String> = (0..3u8).map(|i| format!("big-{i}.bin")).collect();
    let smalls: Vec<String> = (0..100u8).map(|i| format!("shards/s-{i:03}.bin")).collect();
    for (i, rel) in bigs.iter().enumerate() {
        (b.put)(&ckpt.join(rel), &big(i as u8)).unwrap();
    }
    for (i, rel) in smalls.iter().enumerate() {
        (b.put)(&ckpt.join(rel), &small(i as u8)).unwrap();
    }
    (b.put)(&ckpt.join("COMMITTED"), b"").unwrap();
    let markers = ["COMMITTED".to_string()];
    let m = build(b.src, &ckpt, &markers, MIN_CHUNK_SIZE).unwrap();
    let staging = dir.join("staging");
    let mut st = b.sink.staging(&staging);
    for round in 0..3 {
        for (i, rel) in bigs.iter().enumerate() {
            let data = big(i as u8);
            let start = round * cs;
            if start < data.len() {
                st.stage_chunk(rel, start as u64, &data[start..data.len().min(start + cs)])
                    .unwrap();
            }
        }
        if round == 0 {
            for (i, rel) in smalls.iter().enumerate() {
                st.stage_chunk(rel, 0, &small(i as u8)).unwrap();
            }
        }
    }
    st.stage_chunk("COMMITTED", 0, &[]).unwrap();
    st.finish().unwrap();
    drop(st);
    let local = dir.join("replicas/ckpt");
    let out = b
        .sink
        .publish(&staging, &local, &dir.join("versions/1"), &m, None, None)
        .unwrap();
    assert!(matches!(out, PublishOutcome::Published { .. }), "{out:?}");
    b.sink.publish_recorded(&staging).unwrap();
    same_replica(
        b,
        &build(b.src, &local, &markers, MIN_CHUNK_SIZE).unwrap(),
        &m,
    );
}

fn conforms(b: &Backend, dir: &Path, server: &str) {
    small_files(b, &dir.join("small"));
    lists(b, &dir.join("list"));
    rereads_before_publishing(b, &dir.join("reread"));
    reads_ranges(b, &dir.join("read"));
    stages_publishes_and_retires(b, &dir.join("publish"));
    stages_files_in_turns(b, &dir.join("turns"));
    conditional_create(b, &dir.join("create"), server);
}

#[test]
fn posix_backend_conforms() {
    let d = tempfile::tempdir().unwrap();
    let (src, sink) = (&Posix as &dyn SourceStore, &Posix as &dyn SinkStore);
    let put = |p: &Path, data: &[u8]| {
        std::fs::create_dir_all(p.parent().unwrap())?;
        std::fs::write(p, data)
    };
    let put_if_absent = |p: &Path, data: &[u8]| {
        std::fs::create_dir_all(p.parent().unwrap())?;
        match std::fs::File::options()
            .write(true)
            .create_new(true)
            .open(p)
        {
            Ok(mut f) => io::Write::write_all(&mut f, data).map(|()| true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        }
    };
    let b = Backend {
        src,
        sink,
        put: &put,
        put_if_absent: &put_if_absent,
        keeps_metadata: true,
        moves_aside: true,
        shares: "link",
    };
    conforms(&b, &d.path().join("suite"), "the local file system");
    lists_with_sizes_markers_and_versions(src, &d.path().join("list"));
    staging_refuses_symlinks(sink, d.path());
    watches_where_it_can(src, &d.path().join("watch"));
}

/// A test server's address from the environment `ops/test` sets.
fn server_env(var: &str) -> String {
    std::env::var(var).unwrap_or_else(|_| {
        panic!(
            "{var} is not set: these tests need the storage servers that ops/test starts \
             (run ops/test, or ops/with-test-servers cargo test -p replicator --test storage)"
        )
    })
}

/// A directory or key prefix of this test's own.
fn unique(name: &str) -> PathBuf {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    PathBuf::from(format!("/ferry-test/{name}-{}-{t}", std::process::id()))
}

fn hdfs() -> (String, Hdfs) {
    let url = server_env("FERRY_TEST_HDFS_URL");
    let h = Hdfs::connect(&url, None).unwrap();
    (url, h)
}

/// The S3 endpoint, bucket and key pair of the test server.
fn s3_config() -> (String, String, S3Config) {
    let url = server_env("FERRY_TEST_S3_URL");
    let (endpoint, bucket) = url.rsplit_once('/').unwrap();
    let cfg = S3Config {
        endpoint: Some(endpoint.to_string()),
        region: None,
        access_key_id: Some(server_env("FERRY_TEST_S3_ACCESS_KEY_ID")),
        secret_access_key: Some(server_env("FERRY_TEST_S3_SECRET_ACCESS_KEY")),
        capacity: Some(1 << 40),
    };
    (url.clone(), bucket.to_string(), cfg)
}

/// Connects to the test bucket, waiting (at most 120 s) for the server to
/// have created it.
fn s3() -> (String, S3) {
    let (url, bucket, cfg) = s3_config();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        match S3::connect(&format!("s3://{bucket}"), &cfg) {
            Ok(s) => return (url, s),
            Err(e) if std::time::Instant::now() < deadline => {
                eprintln!("waiting for the bucket at {url}: {e}");
                std::thread::sleep(std::time::Duration::from_millis(500));
            }
            Err(e) => panic!("S3 test server at {url}: {e}"),
        }
    }
}

/// The same with each version in its own directory, the published path
/// a pointer file naming it.
#[test]
fn hdfs_with_versions_backend_conforms() {
    let (url, h) = hdfs();
    let h = h.with_share_min(0).with_versions(true);
    let put = |p: &Path, data: &[u8]| h.put_file(p, data);
    let put_if_absent = |p: &Path, data: &[u8]| h.put_if_absent(p, data);
    let b = Backend {
        src: &h,
        sink: &h,
        put: &put,
        put_if_absent: &put_if_absent,
        keeps_metadata: true,
        moves_aside: true,
        shares: "copy",
    };
    let dir = unique("hdfs-versions-suite");
    conforms(
        &b,
        &dir,
        &format!("the MiniDFSCluster at {url}, with versions"),
    );
    // A replica published in place (versions off) is moved into its
    // version directory by `adopt`, once, and read through the pointer.
    let local = dir.join("in-place/step_1");
    h.put_file(&local.join("a.bin"), b"in place").unwrap();
    let v = dir.join("versions/9");
    assert!(h.adopt(&local, &v).unwrap());
    assert!(!h.adopt(&local, &v).unwrap(), "once");
    assert_eq!(h.named_version(&local).unwrap().as_deref(), Some(&*v));
    assert_eq!(
        h.open(&local.join("a.bin"))
            .unwrap()
            .read_range(0, 8)
            .unwrap(),
        b"in place"
    );
    assert_eq!(h.located_url(&local).unwrap(), h.url_of(&v));
}

#[test]
fn hdfs_backend_conforms() {
    let (url, h) = hdfs();
    // Every unchanged file shared by a copy, however small.
    let h = h.with_share_min(0);
    let put = |p: &Path, data: &[u8]| h.put_file(p, data);
    let put_if_absent = |p: &Path, data: &[u8]| h.put_if_absent(p, data);
    let b = Backend {
        src: &h,
        sink: &h,
        put: &put,
        put_if_absent: &put_if_absent,
        keeps_metadata: true,
        moves_aside: true,
        shares: "copy",
    };
    let dir = unique("hdfs-suite");
    conforms(&b, &dir, &format!("the MiniDFSCluster at {url}"));
    // The extra I/O of HDFS staging: only w.bin of the first version,
    // staged out of order, and f.bin of the read-back test, whose first
    // chunk was staged again, were rewritten; files staged in order
    // (every file of the second version) were moved by a rename.
    assert_eq!(
        h.rewritten_bytes(),
        2 * u64::from(MIN_CHUNK_SIZE) + 5 + u64::from(MIN_CHUNK_SIZE) + 100
    );
    // The re-save's unchanged w.bin was copied inside the cluster once.
    assert_eq!(h.copied_bytes(), 2 * u64::from(MIN_CHUNK_SIZE) + 5);
    h.put_file(&dir.join("small/f.bin"), &pattern(1000, 4))
        .unwrap();
    let e = Hdfs::connect(&url, None)
        .unwrap()
        .share_unchanged(&dir.join("small"), &dir.join("staging-small"), "f.bin")
        .unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::Unsupported, "{e}");
    assert!(
        e.to_string().contains("sent again"),
        "files under 64 MiB are sent again, not copied: {e}"
    );
    assert!(
        h.free_space(&dir).unwrap().is_none(),
        "no capacity, no quota"
    );
    let capped = Hdfs::connect(&url, Some(1 << 30)).unwrap();
    let free = capped.free_space(&dir).unwrap().unwrap();
    assert!(
        free > 0 && free < 1 << 30,
        "capacity less what is stored: {free}"
    );
}

#[test]
fn s3_backend_conforms() {
    let (url, s) = s3();
    let put = |p: &Path, data: &[u8]| s.put_file(p, data);
    let put_if_absent = |p: &Path, data: &[u8]| s.put_if_absent(p, data);
    let b = Backend {
        src: &s,
        sink: &s,
        put: &put,
        put_if_absent: &put_if_absent,
        keeps_metadata: false,
        moves_aside: false,
        shares: "in place",
    };
    let dir = unique("s3-suite");
    // The server's conditional create first: the publish relies on it.
    conditional_create(
        &b,
        &dir.join("server-check"),
        &format!("SeaweedFS at {url}"),
    );
    conforms(&b, &dir, &format!("SeaweedFS at {url}"));
    let free = s.free_space(&dir).unwrap().unwrap();
    assert!(
        free > 0 && free < 1 << 40,
        "capacity less what is stored: {free}"
    );
    assert_parts_at_least_min(&s);
}

/// A replica an earlier release published on S3 (its objects under the
/// published path, a commit object without a version) reads as before;
/// a re-save publishes a version that keeps its unchanged object by
/// reference, and the older objects it does not keep are deleted; then
/// withdrawing the re-save leaves nothing.
#[test]
fn s3_replaces_a_replica_published_before_versioned_prefixes() {
    let (_, s) = s3();
    let dir = unique("s3-legacy");
    let cs = MIN_CHUNK_SIZE;
    let local = dir.join("replica");
    let (w, o) = (pattern(cs as usize + 3, 5), pattern(10, 6));
    s.put_file(&local.join("w.bin"), &w).unwrap();
    s.put_file(&local.join("o.bin"), &o).unwrap();
    let m1 = build(&s, &local, &[], cs).unwrap();
    let files: Vec<_> = m1
        .files
        .iter()
        .map(|f| serde_json::json!([f.path, f.size, f.mode, f.mtime_ns]))
        .collect();
    let root: String = m1.root().iter().map(|b| format!("{b:02x}")).collect();
    s.put_file(
        &dir.join("replica.ferry-commit"),
        serde_json::json!({ "root": root, "files": files })
            .to_string()
            .as_bytes(),
    )
    .unwrap();
    assert_eq!(build(&s, &local, &[], cs).unwrap().root(), m1.root());
    assert_eq!(
        s.named_version(&local).unwrap(),
        None,
        "no version of its own"
    );

    // The re-save: w.bin unchanged, o.bin changed.
    let o2 = pattern(12, 7);
    s.put_file(&dir.join("src/w.bin"), &w).unwrap();
    s.put_file(&dir.join("src/o.bin"), &o2).unwrap();
    let m2 = build(&s, &dir.join("src"), &[], cs).unwrap();
    let staging = dir.join("staging");
    s.share_unchanged(&local, &staging, "w.bin").unwrap();
    s.staging(&staging).stage_chunk("o.bin", 0, &o2).unwrap();
    let v = dir.join("versions/2");
    let out = s.publish(&staging, &local, &v, &m2, None, None).unwrap();
    assert!(matches!(out, PublishOutcome::Published { .. }), "{out:?}");
    // A crash between the switch and the deletion of the old objects
    // (one put back): the publish again finds this version published and
    // finishes the deletion.
    s.put_file(&local.join("o.bin"), &o).unwrap();
    let out = s.publish(&staging, &local, &v, &m2, None, None).unwrap();
    assert!(matches!(out, PublishOutcome::Recovered), "{out:?}");
    assert_eq!(build(&s, &local, &[], cs).unwrap().root(), m2.root());
    assert_eq!(s.named_version(&local).unwrap().as_deref(), Some(&*v));
    assert!(
        SourceStore::stat(&s, &local.join("o.bin")).is_ok(),
        "o.bin of the re-save is found through its commit object"
    );
    // The old o.bin is gone; w.bin stays where it was, named by the
    // re-save.
    // (`dir` has no commit object: its listing is the raw objects.)
    let raw = |s: &S3| -> Vec<String> {
        s.list(&dir, &[])
            .unwrap()
            .files
            .into_iter()
            .map(|f| f.info.path)
            .filter(|p| !p.starts_with("src/") && !p.starts_with("staging/"))
            .collect()
    };
    let left: Vec<String> = raw(&s)
        .into_iter()
        .filter(|p| p.starts_with("replica/"))
        .collect();
    assert_eq!(left, ["replica/w.bin"], "objects of the old replica left");
    assert!(s.withdraw(&local, &v, &dir.join("aside"), &[]).unwrap());
    assert!(!s.exists(&local).unwrap());
    let rest = raw(&s);
    assert!(rest.is_empty(), "left after the withdrawal: {rest:?}");
}

/// A commit object (S3) or pointer file (HDFS with versions) changed by
/// hand to name something outside the sink root is refused with an error
/// naming it; nothing outside the root is read, moved or deleted.
#[test]
fn versions_named_outside_the_root_are_refused() {
    let named = |r: io::Result<bool>, what: &str| {
        let e = r.err().unwrap_or_else(|| panic!("{what}: accepted"));
        assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{what}: {e}");
        assert!(e.to_string().contains("outside"), "{what}: {e}");
    };
    // S3: a commit object whose version is another prefix of the bucket.
    let (_, base) = s3();
    let (_, bucket, cfg) = s3_config();
    let dir = unique("s3-tampered");
    base.put_file(&dir.join("outside/x"), b"not the sink's")
        .unwrap();
    base.put_file(&dir.join("sink/README"), b"sink root")
        .unwrap();
    let sink = S3::connect(&format!("s3://{bucket}{}/sink", dir.display()), &cfg).unwrap();
    let outside = format!("{}/outside", dir.display());
    base.put_file(
        &dir.join("sink/replica.ferry-commit"),
        serde_json::json!({ "root": "00", "files": [["x", 14, 420, 0]], "version": outside.trim_start_matches('/') })
            .to_string()
            .as_bytes(),
    )
    .unwrap();
    let (local, v, aside) = (
        dir.join("sink/replica"),
        dir.join("sink/v"),
        dir.join("sink/a"),
    );
    named(sink.withdraw(&local, &v, &aside, &[]), "S3 withdraw");
    named(sink.exists(&local.join("x")), "S3 exists");
    assert_eq!(
        base.open(&dir.join("outside/x"))
            .unwrap()
            .read_range(0, 14)
            .unwrap(),
        b"not the sink's"
    );
    // HDFS: a pointer file naming a directory outside the root.
    let (url, h) = hdfs();
    let dir = unique("hdfs-tampered");
    h.put_file(&dir.join("outside/x"), b"not the sink's")
        .unwrap();
    h.put_file(&dir.join("sink/README"), b"sink root").unwrap();
    let sink = Hdfs::connect(&format!("{url}{}/sink", dir.display()), None)
        .unwrap()
        .with_versions(true);
    h.put_file(
        &dir.join("sink/replica.ferry-version"),
        format!("{}/outside", dir.display()).as_bytes(),
    )
    .unwrap();
    let (local, v, aside) = (
        dir.join("sink/replica"),
        dir.join("sink/v"),
        dir.join("sink/a"),
    );
    named(sink.exists(&local), "HDFS exists");
    named(sink.withdraw(&local, &v, &aside, &[]), "HDFS withdraw");
    assert_eq!(
        h.open(&dir.join("outside/x"))
            .unwrap()
            .read_range(0, 14)
            .unwrap(),
        b"not the sink's"
    );
}

/// Every multipart part but the last is at least 5 MiB (S3 refuses
/// smaller ones, even where a test server accepts them).
fn assert_parts_at_least_min(s: &S3) {
    for parts in s.multipart_parts() {
        if let Some((_, head)) = parts.split_last() {
            assert!(
                head.iter().all(|&p| p >= MIN_PART),
                "a multipart part but the last is under 5 MiB: {parts:?}"
            );
        }
    }
}

/// A file larger than one PUT: staged as 1 MiB chunks in reverse order,
/// published as a multipart upload of 8 MiB parts, read back whole.
#[test]
fn s3_publishes_large_files_in_parts() {
    let (_, s) = s3();
    let dir = unique("s3-parts");
    let cs = 1u32 << 20;
    let data = pattern((20 << 20) + 5, 4);
    s.put_file(&dir.join("src/big.bin"), &data).unwrap();
    let m = build(&s, &dir.join("src"), &[], cs).unwrap();
    let staging = dir.join("staging");
    let mut st = s.staging(&staging);
    for (i, c) in data.chunks(cs as usize).enumerate().rev() {
        st.stage_chunk("big.bin", (i * cs as usize) as u64, c)
            .unwrap();
    }
    let out = s
        .publish(
            &staging,
            &dir.join("replica"),
            &dir.join("v"),
            &m,
            None,
            None,
        )
        .unwrap();
    assert!(matches!(out, PublishOutcome::Published { .. }), "{out:?}");
    let parts = s.multipart_parts();
    assert_eq!(parts, vec![vec![8 << 20, 8 << 20, (4 << 20) + 5]]);
    assert_parts_at_least_min(&s);
    let back = s.open(&dir.join("replica/big.bin")).unwrap();
    assert_eq!(back.read_range(0, data.len() as u64).unwrap(), data);
    let back = build(&s, &dir.join("replica"), &[], cs).unwrap();
    assert_eq!(back.files[0].chunks, m.files[0].chunks);
    // Mode and mtime travel in the commit object.
    let c = s.committed(&dir.join("replica")).unwrap().unwrap();
    assert_eq!(
        c.iter()
            .map(|f| (&f.path, f.size, f.mode, f.mtime_ns))
            .collect::<Vec<_>>(),
        [(
            &m.files[0].path,
            m.files[0].size,
            m.files[0].mode,
            m.files[0].mtime_ns
        )]
    );
    assert!(s
        .withdraw(
            &dir.join("replica"),
            &dir.join("v"),
            &dir.join("aside"),
            &[]
        )
        .unwrap());
    assert!(s.committed(&dir.join("replica")).unwrap().is_none());
}

/// Bad input: clear errors naming the root, no panic.
#[test]
fn bad_remote_roots_are_named() {
    let (hdfs_url, _) = hdfs();
    let (s3_url, bucket, cfg) = s3_config();
    let named = |r: io::Result<()>, root: &str| {
        let e = r.err().unwrap_or_else(|| panic!("{root}: connected"));
        assert!(e.to_string().contains(root), "{root}: {e}");
    };
    // An unreachable NameNode (nothing listens on port 1).
    named(
        Hdfs::connect("hdfs://127.0.0.1:1/ckpt", None).map(drop),
        "hdfs://127.0.0.1:1/ckpt",
    );
    // A root directory that does not exist.
    let missing = format!("{hdfs_url}{}", unique("missing").display());
    named(Hdfs::connect(&missing, None).map(drop), &missing);
    // An unreachable endpoint.
    let nowhere = S3Config {
        endpoint: Some("http://127.0.0.1:1".into()),
        ..cfg.clone()
    };
    named(
        S3::connect("s3://ferry/x", &nowhere).map(drop),
        "s3://ferry/x",
    );
    // Wrong credentials.
    let wrong = S3Config {
        secret_access_key: Some("not-the-secret".into()),
        ..cfg.clone()
    };
    let root = format!("s3://{bucket}/x");
    named(S3::connect(&root, &wrong).map(drop), &root);
    // A bucket that does not exist.
    named(
        S3::connect("s3://no-such-bucket-ferry/x", &cfg).map(drop),
        "s3://no-such-bucket-ferry/x",
    );
    // A path outside the root.
    let dir = unique("outside");
    let (_, h) = hdfs();
    h.put_file(&dir.join("inside/f"), b"x").unwrap();
    let inside = format!("{hdfs_url}{}", dir.join("inside").display());
    let h = Hdfs::connect(&inside, None).unwrap();
    let e = h.list(Path::new("/etc"), &[]).unwrap_err().to_string();
    assert!(e.contains(&inside), "{e}");
    let e = h
        .staging(&dir.join("inside/st"))
        .stage_chunk("../../x", 0, b"x")
        .unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    let _ = s3_url;
}
