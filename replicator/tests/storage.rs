//! Conformance suite of the storage seams: what the source and the sink
//! rely on, written once against the traits and run for every backend
//! (POSIX here; the HDFS and S3 backends join with their servers).
#![allow(clippy::unwrap_used)]

use std::path::Path;

use ferry_proto::manifest::MIN_CHUNK_SIZE;
use replicator::storage::posix::Posix;
use replicator::storage::{build, PublishOutcome, SinkStore, SourceStore, WatchEvent};

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

/// Ranged reads: exact ranges, end of file named, current size.
fn reads_ranges(src: &dyn SourceStore, dir: &Path) {
    write(dir, "r.bin", 300, 5);
    let data = std::fs::read(dir.join("r.bin")).unwrap();
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
/// and replacing it at the same path; then retired.
fn stages_publishes_and_retires(src: &dyn SourceStore, sink: &dyn SinkStore, dir: &Path) {
    let cs = MIN_CHUNK_SIZE;
    let ckpt = dir.join("ckpt");
    write(&ckpt, "w.bin", cs as usize * 2 + 5, 1);
    write(&ckpt, "opt/o.bin", 7, 2);
    write(&ckpt, "COMMITTED", 0, 0);
    let markers = ["COMMITTED".to_string()];
    let m1 = build(src, &ckpt, &markers, cs).unwrap();
    let staging = dir.join("staging-1");
    let local = dir.join("replicas/ckpt");
    {
        let mut st = sink.staging(&staging);
        // Chunks in reverse order, as streams deliver them.
        for f in m1.files.iter().rev() {
            let data = std::fs::read(ckpt.join(&f.path)).unwrap();
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
    let out = sink.publish(&staging, &local, &m1, None).unwrap();
    assert!(matches!(out, PublishOutcome::Published { .. }), "{out:?}");
    sink.publish_recorded(&staging).unwrap();
    assert!(!sink.publish_under_way(&staging));
    let again = build(src, &local, &markers, cs).unwrap();
    assert_eq!(again.root(), m1.root(), "the replica is byte-identical");

    // Version 2: w.bin unchanged (shared), o.bin rewritten.
    write(&ckpt, "opt/o.bin", 9, 3);
    let m2 = build(src, &ckpt, &markers, cs).unwrap();
    let staging2 = dir.join("staging-2");
    sink.share_unchanged(&local, &staging2, "w.bin").unwrap();
    {
        let mut st = sink.staging(&staging2);
        st.stage_chunk(
            "opt/o.bin",
            0,
            &std::fs::read(ckpt.join("opt/o.bin")).unwrap(),
        )
        .unwrap();
        st.stage_chunk("COMMITTED", 0, &[]).unwrap();
    }
    let out = sink.publish(&staging2, &local, &m2, None).unwrap();
    assert!(matches!(out, PublishOutcome::Published { .. }), "{out:?}");
    sink.publish_recorded(&staging2).unwrap();
    assert_eq!(build(src, &local, &markers, cs).unwrap().root(), m2.root());

    // A staging area that never got published is discarded without a
    // trace; discarding twice is no error.
    let staging3 = dir.join("staging-3");
    sink.staging(&staging3).stage_chunk("x", 0, b"x").unwrap();
    sink.discard(&staging3).unwrap();
    sink.discard(&staging3).unwrap();
    assert!(!staging3.exists());

    assert!(sink.free_space(dir).unwrap().is_none_or(|b| b > 0));
    sink.flush(dir).unwrap();
    // Withdrawn in one step (nothing left at the published path), then
    // deleted; both steps may be repeated (a restart finishing them).
    let aside = dir.join("retired/1");
    assert!(sink.withdraw(&local, &aside).unwrap());
    assert!(
        src.list(&local, &[]).is_err(),
        "withdrawn: nothing left to list at the published path"
    );
    assert_eq!(
        build(src, &aside, &markers, cs).unwrap().root(),
        m2.root(),
        "the whole version moved aside"
    );
    assert!(!sink.withdraw(&local, &aside).unwrap(), "withdrawn already");
    sink.retire(&aside).unwrap();
    sink.retire(&aside).unwrap();
    assert!(src.list(&aside, &[]).is_err(), "retired: nothing left");
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

#[test]
fn posix_backend_conforms() {
    let d = tempfile::tempdir().unwrap();
    let (src, sink) = (&Posix as &dyn SourceStore, &Posix as &dyn SinkStore);
    lists_with_sizes_markers_and_versions(src, &d.path().join("list"));
    reads_ranges(src, &d.path().join("read"));
    stages_publishes_and_retires(src, sink, &d.path().join("publish"));
    staging_refuses_symlinks(sink, d.path());
    watches_where_it_can(src, &d.path().join("watch"));
}
