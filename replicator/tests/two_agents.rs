//! A source and a sink in one process, joined by the in-memory emulated
//! link: a checkpoint with small, multi-chunk and empty shards replicates
//! byte for byte, resolves, and a re-push replaces the replica atomically.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use ferry_proto::state::TransferState;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{pair, same_tree, wait_final, wait_published};
use ferry_proto::manifest::MIN_CHUNK_SIZE;
use replicator::sink::Resolution;

fn write_checkpoint(dir: &Path, seed: u8) {
    std::fs::create_dir_all(dir.join("sub/deeper")).unwrap();
    let data = |n: usize| {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect::<Vec<_>>()
    };
    std::fs::write(
        dir.join("__0_0.distcp"),
        data(3 * MIN_CHUNK_SIZE as usize + 123),
    )
    .unwrap();
    std::fs::write(dir.join("sub/bias.bin"), data(700)).unwrap();
    std::fs::write(dir.join("sub/deeper/empty"), b"").unwrap();
    std::fs::write(dir.join(".metadata.tmp"), b"temporary: never replicated").unwrap();
    std::fs::write(dir.join(".metadata"), data(99)).unwrap();
}

#[tokio::test]
async fn checkpoint_replicates_resolves_and_is_replaced_on_resave() {
    let p = pair(0).await;
    let ckpt = p.root.join("step_2");
    write_checkpoint(&ckpt, 1);
    let t = p.source.submit(&ckpt, None).await.unwrap();
    let again = p.source.submit(&ckpt, None).await.unwrap();
    assert_eq!(
        again.id, t.id,
        "a second push of a queued checkpoint is the same transfer"
    );
    let done = wait_published(&p, t.id).await;
    let replica = PathBuf::from(done.local_path.unwrap());
    assert_eq!(replica, p.dir.path().join("eval/train-a/job/step_2"));
    assert!(
        !replica.join(".metadata.tmp").exists(),
        "temporaries are not replicated"
    );
    std::fs::remove_file(ckpt.join(".metadata.tmp")).unwrap();
    same_tree(&ckpt, &replica);

    let under = format!("{}/sub/bias.bin", ckpt.display());
    match p.sink.resolve(&under).await.unwrap() {
        Resolution::Local { local_path, .. } => {
            assert_eq!(
                local_path.map(PathBuf::from),
                Some(replica.join("sub/bias.bin"))
            )
        }
        other => panic!("expected local, got {other:?}"),
    }
    // Paths are normalised; `..` and files the checkpoint lacks have no twin.
    let messy = format!("{}//sub/./bias.bin", ckpt.display());
    assert!(matches!(
        p.sink.resolve(&messy).await.unwrap(),
        Resolution::Local { .. }
    ));
    let escape = format!("{}/../../../etc/passwd", ckpt.display());
    assert_eq!(p.sink.resolve(&escape).await.unwrap(), Resolution::Unknown);
    let missing = format!("{}/no-such-file", ckpt.display());
    assert_eq!(p.sink.resolve(&missing).await.unwrap(), Resolution::Unknown);

    // A directory inside a replicated checkpoint would overlap it at the sink.
    let nested = p.source.submit(&ckpt.join("sub"), None).await.unwrap();
    let failed = wait_final(&p, nested.id).await;
    assert_eq!(failed.state, TransferState::Failed);
    assert!(failed.error.unwrap().contains("overlap"));

    let report = replicator::verify::check(
        &replica,
        &replicator::storage::build(
            &replicator::storage::posix::Posix,
            &ckpt,
            &[],
            MIN_CHUNK_SIZE,
        )
        .unwrap(),
    );
    assert!(report.problems.is_empty(), "{:?}", report.problems);

    // A re-save at the same path becomes a new version in place.
    write_checkpoint(&ckpt, 2);
    std::fs::remove_file(ckpt.join(".metadata.tmp")).unwrap();
    let t2 = p.source.submit(&ckpt, None).await.unwrap();
    wait_published(&p, t2.id).await;
    same_tree(&ckpt, &replica);

    // A re-save that changes one small file: unchanged files are reused at
    // the sink, only the changed one crosses the link.
    std::fs::write(ckpt.join("sub/bias.bin"), vec![7u8; 700]).unwrap();
    let t3 = p.source.submit(&ckpt, None).await.unwrap();
    let done3 = wait_published(&p, t3.id).await;
    same_tree(&ckpt, &replica);
    assert_eq!(
        done3.bytes_sent, 700,
        "only the changed file is sent: {done3:?}"
    );

    // Same size and mtime but other bytes: the sealed manifest's hashes
    // catch it, and the published version is never written in place (a
    // second hard link to its file must keep the old bytes).
    let big = ckpt.join("__0_0.distcp");
    let mtime = std::fs::metadata(&big).unwrap().modified().unwrap();
    let witness = p.dir.path().join("witness");
    std::fs::hard_link(replica.join("__0_0.distcp"), &witness).unwrap();
    let before = std::fs::read(&witness).unwrap();
    let mut changed = std::fs::read(&big).unwrap();
    changed[5] ^= 0xff;
    std::fs::write(&big, &changed).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&big)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    let t4 = p.source.submit(&ckpt, None).await.unwrap();
    wait_published(&p, t4.id).await;
    same_tree(&ckpt, &replica);
    assert_eq!(
        std::fs::read(&witness).unwrap(),
        before,
        "published bytes were overwritten in place"
    );

    let staging = p.dir.path().join("eval/.ferry/staging");
    assert_eq!(
        std::fs::read_dir(staging).unwrap().count(),
        0,
        "staging is cleaned up"
    );
}

#[tokio::test]
async fn sink_without_room_refuses_and_publishes_nothing() {
    let p = pair(u64::MAX / 4).await;
    let ckpt = p.root.join("step_9");
    write_checkpoint(&ckpt, 3);
    let t = p.source.submit(&ckpt, None).await.unwrap();
    let mut last = None;
    for _ in 0..400 {
        let t = p.source.catalog().transfer(t.id).await.unwrap().unwrap();
        if t.state == TransferState::Failed {
            last = Some(t);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let t = last.expect("transfer should fail");
    assert!(t.error.unwrap().contains("not enough space"));
    assert!(
        !p.dir.path().join("eval/train-a").exists(),
        "nothing published"
    );
}

#[tokio::test]
async fn paths_outside_source_roots_are_refused() {
    let p = pair(0).await;
    let e = p.source.submit(p.dir.path(), None).await.unwrap_err();
    assert!(
        e.to_string()
            .contains("not under any configured source root"),
        "{e}"
    );
    let e = p
        .source
        .submit(&p.root.join("missing"), None)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("missing"), "{e}");
}
