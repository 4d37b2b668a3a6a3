//! The watcher and predictive replication, in process: real checkpoint
//! saves (torch DCP, transformers safetensors) replayed from their recorded
//! write order into a watched root; shards stream while they are written,
//! the replica is published only after the commit, byte for byte.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use ferry_proto::state::{CheckpointState, TransferId, TransferState};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::replay::Replay;
use common::{pair_with, same_tree, wait_final, wait_published, Pair};
use ferry_catalog::Transfer;
use ferry_proto::manifest::MIN_CHUNK_SIZE;
use replicator::sink::Resolution;
use replicator::source::watcher::{Mode, RootWatch, Start};
use replicator::source::SourceConfig;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn watching(watch: RootWatch) -> impl FnOnce(&mut SourceConfig) {
    move |cfg: &mut SourceConfig| {
        cfg.scan_interval = Some(Duration::from_millis(200));
        cfg.markers = vec!["COMMITTED".into()];
        cfg.roots[0].watch = watch;
    }
}

/// The recorded torch DCP save of `step_00000002`, to replay into the
/// watched root.
fn dcp_save(p: &Pair) -> Replay {
    let src = fixtures().join("dcp");
    Replay::new(
        &src.join("dcp_save_trace.jsonl"),
        &src,
        &p.root,
        "step_00000002",
    )
}

/// Waits for the watcher to queue a transfer of `dir`.
async fn transfer_of(p: &Pair, dir: &Path) -> Transfer {
    let path = dir.to_string_lossy();
    for _ in 0..400 {
        if let Some(t) = p.source.catalog().transfer_by_path(&path).await.unwrap() {
            return t;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no transfer of {path} within 20 s");
}

/// Waits until the source has put at least `bytes` on the wire for `id`.
async fn wait_sent(p: &Pair, id: TransferId, bytes: u64) {
    for _ in 0..400 {
        if p.source.progress(id).is_some_and(|g| g.bytes_sent >= bytes) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!(
        "transfer {id} sent {:?}, expected at least {bytes} bytes",
        p.source.progress(id)
    );
}

fn size(p: &Path) -> u64 {
    std::fs::metadata(p).unwrap().len()
}

async fn assert_not_published(p: &Pair, dir: &Path) {
    let r = p.sink.resolve(&dir.to_string_lossy()).await.unwrap();
    assert!(
        !matches!(r, Resolution::Local { .. }),
        "published before the commit: {r:?}"
    );
    assert!(!p
        .dir
        .path()
        .join("eval/train-a/job")
        .join(dir.file_name().unwrap())
        .exists());
}

#[tokio::test]
async fn dcp_save_streams_while_written_and_publishes_at_commit() {
    let p = pair_with(0, watching(RootWatch::default())).await;
    let mut save = dcp_save(&p);
    let ckpt = p.root.join("step_00000002");
    // Everything up to the commit: both ranks' shards written and closed,
    // `.metadata.tmp` written, not yet renamed.
    save.run_until(|o| o.op == "rename").await;
    let t = transfer_of(&p, &ckpt).await;
    assert_eq!(t.format.as_deref(), Some("dcp"));
    let shards = size(&ckpt.join("__0_0.distcp")) + size(&ckpt.join("__1_0.distcp"));
    wait_sent(&p, t.id, shards).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_not_published(&p, &ckpt).await;

    save.finish().await;
    let done = wait_published(&p, t.id).await;
    let replica = PathBuf::from(done.local_path.unwrap());
    same_tree(&ckpt, &replica);
    assert!(!replica.join(".metadata.tmp").exists());
    let t = p.source.catalog().transfer(t.id).await.unwrap().unwrap();
    assert_eq!(t.checkpoint, CheckpointState::Committed);
    assert!(t.committed_at.is_some() && t.opened_at.is_some());
    let rows = p
        .sink
        .catalog()
        .replicas_for_source(&ckpt.to_string_lossy())
        .await
        .unwrap();
    let row = rows
        .iter()
        .find(|r| r.state == TransferState::Published)
        .unwrap();
    assert_eq!(
        row.bytes_total as u64,
        shards + size(&ckpt.join(".metadata")),
        "the sink's row holds the sealed size, not the size at open"
    );
    let lag = row
        .commit_to_replica_s
        .expect("commit_to_replica_s recorded");
    let open_lag = row.open_to_replica_s.expect("open_to_replica_s recorded");
    assert!(lag >= 0.0 && open_lag >= lag, "{lag} {open_lag}");

    // A re-save in place (new bytes, `.metadata` renamed over the old one)
    // is a new commit identity: a new transfer, a new replica version.
    let mut bytes = std::fs::read(ckpt.join("__0_0.distcp")).unwrap();
    bytes[100] ^= 0x5a;
    std::fs::write(ckpt.join("__0_0.distcp"), &bytes).unwrap();
    let meta = std::fs::read(ckpt.join(".metadata")).unwrap();
    std::fs::write(ckpt.join(".metadata.tmp"), &meta).unwrap();
    std::fs::rename(ckpt.join(".metadata.tmp"), ckpt.join(".metadata")).unwrap();
    let mut second = None;
    for _ in 0..400 {
        let t2 = p
            .source
            .catalog()
            .transfer_by_path(&ckpt.to_string_lossy())
            .await
            .unwrap()
            .unwrap();
        if t2.id != t.id {
            second = Some(t2);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let t2 = second.expect("a re-save starts a new transfer");
    wait_published(&p, t2.id).await;
    same_tree(&ckpt, &replica);
}

#[tokio::test]
async fn safetensors_save_waits_for_a_whole_index() {
    let p = pair_with(0, watching(RootWatch::default())).await;
    let src = fixtures().join("safetensors/checkpoint");
    let ckpt = p.root.join("checkpoint");
    let mut save = Replay::new(
        &fixtures().join("safetensors/safetensors_save_trace.jsonl"),
        &src,
        &ckpt,
        "",
    );
    save.run_until(|o| o.path == "model.safetensors.index.json")
        .await;
    let t = transfer_of(&p, &ckpt).await;
    assert_eq!(t.format.as_deref(), Some("hf"));
    let shards: u64 = (1..=3)
        .map(|i| size(&ckpt.join(format!("model-0000{i}-of-00003.safetensors"))))
        .sum();
    wait_sent(&p, t.id, shards).await;
    // A half-written index (the marker is written in place) is re-read
    // later, not taken as a commit and not an error.
    let index = std::fs::read(src.join("model.safetensors.index.json")).unwrap();
    std::fs::write(
        ckpt.join("model.safetensors.index.json"),
        &index[..index.len() / 2],
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_not_published(&p, &ckpt).await;
    let t_now = p.source.catalog().transfer(t.id).await.unwrap().unwrap();
    assert!(!t_now.state.is_final(), "{t_now:?}");

    save.finish().await;
    let done = wait_published(&p, t.id).await;
    same_tree(&ckpt, Path::new(&done.local_path.unwrap()));
}

#[tokio::test]
async fn checkpoint_deleted_mid_write_is_cancelled_and_staging_removed() {
    let p = pair_with(0, watching(RootWatch::default())).await;
    let mut save = dcp_save(&p);
    let ckpt = p.root.join("step_00000002");
    // Rank 1's shard is closed, rank 0's is being written.
    save.run_until(|o| o.op == "write_bytes" && o.path.ends_with("__0_0.distcp"))
        .await;
    let t = transfer_of(&p, &ckpt).await;
    wait_sent(&p, t.id, size(&ckpt.join("__1_0.distcp"))).await;
    std::fs::remove_dir_all(&ckpt).unwrap();
    let t = wait_final(&p, t.id).await;
    assert_eq!(t.state, TransferState::Cancelled, "{t:?}");
    assert!(t.error.unwrap().contains("deleted"));
    let staging = p.dir.path().join("eval/.ferry/staging");
    for _ in 0..100 {
        if std::fs::read_dir(&staging).unwrap().count() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        std::fs::read_dir(&staging).unwrap().count(),
        0,
        "staging removed"
    );
    assert!(!p.dir.path().join("eval/train-a/job/step_00000002").exists());
}

#[tokio::test]
async fn appended_shard_rewritten_below_its_end_is_sent_again() {
    rewritten_below_its_end_is_sent_again(1).await;
}

/// The same over a link served by four connections: the transfer opens,
/// grows its file table and sends its batches through the pool, and the
/// changed chunk is still caught and sent again. (The dispatcher gives
/// each chunk to the connection with the least unsent bytes, so the
/// chunks spread over the pool.)
#[tokio::test]
async fn over_four_connections_a_shard_rewritten_below_its_end_is_sent_again() {
    rewritten_below_its_end_is_sent_again(4).await;
}

/// A shard still being appended to streams its full chunks; then one of
/// them is rewritten in place and the shard appended to and closed. The
/// replica holds the final bytes, and the changed chunk went twice (the
/// transfer sent at least a chunk more than the checkpoint's size).
async fn rewritten_below_its_end_is_sent_again(connections: usize) {
    use std::io::Write;
    use std::os::unix::fs::FileExt;
    let p = pair_with(0, |cfg| {
        watching(RootWatch::default())(cfg);
        cfg.links[0].connections = connections;
    })
    .await;
    let ckpt = p.root.join("step_7");
    std::fs::create_dir_all(&ckpt).unwrap();
    let cs = MIN_CHUNK_SIZE as usize;
    let src = fixtures().join("dcp/step_00000002");
    let bytes = std::fs::read(src.join("__0_0.distcp")).unwrap();
    let mut f = std::fs::File::create(ckpt.join("__0_0.distcp")).unwrap();
    f.write_all(&bytes[..4 * cs]).unwrap();
    // Still open: the full chunks stream before the close.
    let t = transfer_of(&p, &ckpt).await;
    wait_sent(&p, t.id, 4 * cs as u64).await;
    // Rewritten below its old end, then appended to and closed.
    f.write_all_at(&[0xee; 1000], cs as u64 + 10).unwrap();
    f.write_all(&bytes[4 * cs..]).unwrap();
    drop(f);
    std::fs::copy(src.join(".metadata"), ckpt.join(".metadata.tmp")).unwrap();
    std::fs::rename(ckpt.join(".metadata.tmp"), ckpt.join(".metadata")).unwrap();
    let done = wait_published(&p, t.id).await;
    same_tree(&ckpt, Path::new(done.local_path.as_deref().unwrap()));
    let total = bytes.len() + size(&ckpt.join(".metadata")) as usize;
    assert!(
        done.bytes_sent as usize >= total + cs,
        "the changed chunk went again: {done:?}"
    );
}

#[tokio::test]
async fn poll_mode_picks_up_a_checkpoint_written_before_the_agent_started() {
    written_before_start(Mode::Poll).await;
}

#[tokio::test]
async fn inotify_mode_rescans_what_was_written_before_the_agent_started() {
    written_before_start(Mode::Inotify).await;
}

/// No close event was ever seen for these files: the rescan, the quiet
/// period and the format checks make them complete.
async fn written_before_start(mode: Mode) {
    let src = fixtures().join("dcp/step_00000002");
    let watch = RootWatch {
        mode,
        start: Start::OnOpen,
        ..Default::default()
    };
    let p = pair_with(0, move |cfg| {
        let ckpt = cfg.roots[0].path.join("step_00000002");
        std::fs::create_dir_all(&ckpt).unwrap();
        for e in std::fs::read_dir(&src).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), ckpt.join(e.file_name())).unwrap();
        }
        watching(watch)(cfg);
    })
    .await;
    let ckpt = p.root.join("step_00000002");
    let t = transfer_of(&p, &ckpt).await;
    let done = wait_published(&p, t.id).await;
    same_tree(&ckpt, Path::new(&done.local_path.unwrap()));
}

#[tokio::test]
async fn on_commit_waits_for_the_marker_before_queueing() {
    let watch = RootWatch {
        start: Start::OnCommit,
        ..Default::default()
    };
    let p = pair_with(0, watching(watch)).await;
    let mut save = dcp_save(&p);
    save.slowdown = 0.0;
    let ckpt = p.root.join("step_00000002");
    save.run_until(|o| o.op == "rename").await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        p.source
            .catalog()
            .transfer_by_path(&ckpt.to_string_lossy())
            .await
            .unwrap()
            .is_none(),
        "on_commit queued an open checkpoint"
    );
    save.finish().await;
    let t = transfer_of(&p, &ckpt).await;
    let done = wait_published(&p, t.id).await;
    same_tree(&ckpt, Path::new(&done.local_path.unwrap()));
}

#[tokio::test]
async fn announced_checkpoint_waits_for_its_first_bytes() {
    let p = pair_with(0, watching(RootWatch::default())).await;
    let ckpt = p.root.join("step_00000002");
    // Wrong job and a path outside the roots are refused by name.
    let e = p.source.announce("other", 2, &ckpt, 1).await.unwrap_err();
    assert!(e.to_string().contains("job"), "{e}");
    let e = p
        .source
        .announce("job", 2, &p.dir.path().join("elsewhere/step_2"), 1)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("source root"), "{e}");
    let e = p
        .source
        .announce("job", 2, &p.root.join("step_2.tmp"), 1)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("temporary"), "{e}");

    let t = p
        .source
        .announce("job", 2, &ckpt, 6_331_267)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(t.checkpoint, CheckpointState::Announced);
    assert_eq!(t.bytes_total, 6_331_267);
    tokio::time::sleep(Duration::from_millis(600)).await;
    let still = p.source.catalog().transfer(t.id).await.unwrap().unwrap();
    assert_eq!(
        still.state,
        TransferState::Queued,
        "it waits for data: {still:?}"
    );
    let again = p
        .source
        .announce("job", 2, &ckpt, 0)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.id, t.id, "announcing twice is one transfer");

    let mut save = dcp_save(&p);
    save.slowdown = 0.0;
    save.finish().await;
    let done = wait_published(&p, t.id).await;
    same_tree(&ckpt, Path::new(done.local_path.as_deref().unwrap()));
    assert!(done.opened_at.is_some());
    assert_eq!(
        done.format.as_deref(),
        Some("dcp"),
        "recognised once it opened"
    );
    let all = p
        .source
        .catalog()
        .transfers_for_path(&ckpt.to_string_lossy())
        .await
        .unwrap();
    assert_eq!(
        all.len(),
        1,
        "the announced transfer carried the checkpoint"
    );
}

#[tokio::test]
async fn weights_only_profile_leaves_optimizer_state_behind() {
    use ferry_proto::state::Profile;
    let watch = RootWatch {
        profile: Profile::WeightsOnly,
        ..Default::default()
    };
    let p = pair_with(0, watching(watch)).await;
    // An HF Trainer checkpoint: model shards, optimizer state, trainer
    // state last.
    let ckpt = p.root.join("checkpoint-10");
    std::fs::create_dir_all(&ckpt).unwrap();
    let model = fixtures().join("safetensors/checkpoint");
    for e in std::fs::read_dir(&model).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), ckpt.join(e.file_name())).unwrap();
    }
    // torch.save archives (so their format check passes should the
    // watcher start after they were closed): the DCP fixture's bytes.
    let archive = std::fs::read(fixtures().join("dcp/step_00000002/__1_0.distcp")).unwrap();
    for name in ["optimizer.pt", "scheduler.pt", "rng_state_0.pth"] {
        std::fs::write(ckpt.join(name), &archive).unwrap();
    }
    std::fs::write(ckpt.join("trainer_state.json"), br#"{"global_step": 10}"#).unwrap();
    // A DCP checkpoint cannot be split: it is not replicated at all.
    let dcp = p.root.join("step_00000002");
    std::fs::create_dir_all(&dcp).unwrap();
    for e in std::fs::read_dir(fixtures().join("dcp/step_00000002")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dcp.join(e.file_name())).unwrap();
    }

    let t = transfer_of(&p, &ckpt).await;
    assert_eq!(t.profile, Profile::WeightsOnly);
    let done = wait_published(&p, t.id).await;
    let replica = PathBuf::from(done.local_path.unwrap());
    for gone in ["optimizer.pt", "scheduler.pt", "rng_state_0.pth"] {
        assert!(!replica.join(gone).exists(), "{gone} was replicated");
        std::fs::remove_file(ckpt.join(gone)).unwrap();
    }
    same_tree(&ckpt, &replica);
    match p.sink.resolve(&ckpt.to_string_lossy()).await.unwrap() {
        Resolution::Local { profile, .. } => assert_eq!(profile, Some(Profile::WeightsOnly)),
        other => panic!("expected local, got {other:?}"),
    }
    assert!(
        p.source
            .catalog()
            .transfer_by_path(&dcp.to_string_lossy())
            .await
            .unwrap()
            .is_none(),
        "a DCP checkpoint was queued under weights-only"
    );
}

fn committed_dir(root: &Path, name: &str, seed: u8) -> PathBuf {
    let d = root.join(name);
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("weights.bin"), vec![seed; 70_000]).unwrap();
    std::fs::write(d.join("COMMITTED"), b"").unwrap();
    d
}

#[tokio::test]
async fn every_n_steps_replicates_only_the_eval_cadence() {
    use replicator::source::watcher::Selection;
    let watch = RootWatch {
        select: Selection::EveryNSteps(1000),
        ..Default::default()
    };
    let p = pair_with(0, watching(watch)).await;
    let skipped = committed_dir(&p.root, "step_1500", 1);
    let kept = committed_dir(&p.root, "step_2000", 2);
    let t = transfer_of(&p, &kept).await;
    wait_published(&p, t.id).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(p
        .source
        .catalog()
        .transfer_by_path(&skipped.to_string_lossy())
        .await
        .unwrap()
        .is_none());
    // An announcement of a step off the cadence is not selected either.
    let off = p
        .source
        .announce("job", 2500, &p.root.join("step_2500"), 1)
        .await
        .unwrap();
    assert!(off.is_none());
}

#[tokio::test]
async fn latest_only_cancels_an_older_checkpoint_still_moving() {
    use replicator::source::watcher::Selection;
    let watch = RootWatch {
        select: Selection::LatestOnly,
        ..Default::default()
    };
    let p = pair_with(0, watching(watch)).await;
    // Step 2 is being written (no .metadata yet) when step 4 starts.
    let mut save = dcp_save(&p);
    save.slowdown = 0.0;
    save.run_until(|o| o.op == "rename").await;
    let old = p.root.join("step_00000002");
    let t_old = transfer_of(&p, &old).await;
    let new = p.root.join("step_00000004");
    std::fs::create_dir_all(&new).unwrap();
    std::fs::copy(old.join("__0_0.distcp"), new.join("__0_0.distcp")).unwrap();
    let t_old = wait_final(&p, t_old.id).await;
    assert_eq!(t_old.state, TransferState::Cancelled, "{t_old:?}");
    assert!(t_old.error.unwrap().contains("latest_only"));
    std::fs::write(new.join(".metadata"), b"m").unwrap();
    let t_new = transfer_of(&p, &new).await;
    wait_published(&p, t_new.id).await;
}

#[tokio::test]
async fn idle_checkpoint_is_abandoned_and_its_staging_removed() {
    let p = pair_with(0, |cfg| {
        watching(RootWatch::default())(cfg);
        cfg.checkpoint_idle_timeout = Duration::from_secs(2);
    })
    .await;
    let ckpt = p.root.join("step_00000002");
    std::fs::create_dir_all(&ckpt).unwrap();
    std::fs::copy(
        fixtures().join("dcp/step_00000002/__0_0.distcp"),
        ckpt.join("__0_0.distcp"),
    )
    .unwrap();
    // Rank 1 never finishes; no .metadata ever comes.
    let t = transfer_of(&p, &ckpt).await;
    let t = wait_final(&p, t.id).await;
    assert_eq!(t.state, TransferState::Cancelled, "{t:?}");
    assert!(
        t.error.as_deref().unwrap_or("").contains("abandoned"),
        "{t:?}"
    );
    assert_eq!(t.checkpoint, CheckpointState::Abandoned);
    let staging = p.dir.path().join("eval/.ferry/staging");
    for _ in 0..100 {
        if std::fs::read_dir(&staging).unwrap().count() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(std::fs::read_dir(&staging).unwrap().count(), 0);
    // Nothing more happens to it, however long it sits there.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let all = p
        .source
        .catalog()
        .transfers_for_path(&ckpt.to_string_lossy())
        .await
        .unwrap();
    assert_eq!(all.len(), 1);
}

#[tokio::test]
async fn orbax_checkpoint_is_copied_once_renamed_into_place() {
    let p = pair_with(0, watching(RootWatch::default())).await;
    let tmp = p.root.join("5.orbax-checkpoint-tmp-1712345678");
    std::fs::create_dir_all(tmp.join("state")).unwrap();
    std::fs::write(tmp.join("state/array.bin"), vec![9u8; 100_000]).unwrap();
    std::fs::write(tmp.join("_CHECKPOINT_METADATA"), b"{}").unwrap();
    std::fs::write(tmp.join("commit_success.txt"), b"ok").unwrap();
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(
        p.source
            .catalog()
            .transfer_by_path(&tmp.to_string_lossy())
            .await
            .unwrap()
            .is_none(),
        "a temporary Orbax directory was queued"
    );
    let fin = p.root.join("5");
    std::fs::rename(&tmp, &fin).unwrap();
    let t = transfer_of(&p, &fin).await;
    assert_eq!(t.format.as_deref(), Some("orbax"));
    let done = wait_published(&p, t.id).await;
    same_tree(&fin, Path::new(done.local_path.as_deref().unwrap()));
}

#[tokio::test]
async fn truncated_shard_is_never_published_even_with_its_marker() {
    let p = pair_with(0, watching(RootWatch::default())).await;
    let ckpt = p.root.join("step_00000002");
    std::fs::create_dir_all(&ckpt).unwrap();
    let src = fixtures().join("dcp/step_00000002");
    std::fs::copy(src.join("__0_0.distcp"), ckpt.join("__0_0.distcp")).unwrap();
    // Rank 1's shard lost its last 1000 bytes (the end record of its
    // last torch.save item), yet rank 0 wrote `.metadata`.
    let bytes = std::fs::read(src.join("__1_0.distcp")).unwrap();
    std::fs::write(ckpt.join("__1_0.distcp"), &bytes[..bytes.len() - 1000]).unwrap();
    std::fs::copy(src.join(".metadata"), ckpt.join(".metadata")).unwrap();
    let t = transfer_of(&p, &ckpt).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t = p.source.catalog().transfer(t.id).await.unwrap().unwrap();
    assert_eq!(t.checkpoint, CheckpointState::Open, "{t:?}");
    assert!(!t.state.is_final(), "{t:?}");
    assert!(
        t.error.as_deref().unwrap_or("").contains("__1_0.distcp"),
        "the transfer says which file it waits for: {t:?}"
    );
    assert_not_published(&p, &ckpt).await;
    // The writer finishes the file: now it commits.
    std::fs::write(ckpt.join("__1_0.distcp"), &bytes).unwrap();
    let done = wait_published(&p, t.id).await;
    same_tree(&ckpt, Path::new(done.local_path.as_deref().unwrap()));
}

#[tokio::test]
async fn a_newer_commit_abandons_a_killed_save_that_held_the_link() {
    let p = pair_with(0, watching(RootWatch::default())).await;
    let src = fixtures().join("dcp/step_00000002");
    // The save of step 2 was killed: one shard whole, one cut short, no
    // `.metadata`. Its transfer holds the link, waiting for more data.
    let killed = p.root.join("step_00000002");
    std::fs::create_dir_all(&killed).unwrap();
    std::fs::copy(src.join("__0_0.distcp"), killed.join("__0_0.distcp")).unwrap();
    let half = std::fs::read(src.join("__1_0.distcp")).unwrap();
    std::fs::write(killed.join("__1_0.distcp"), &half[..half.len() / 2]).unwrap();
    let t_killed = transfer_of(&p, &killed).await;
    // Training restarted and saved step 4 completely.
    let next = p.root.join("step_00000004");
    std::fs::create_dir_all(&next).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), next.join(e.file_name())).unwrap();
    }
    let t_killed = wait_final(&p, t_killed.id).await;
    assert_eq!(t_killed.state, TransferState::Cancelled, "{t_killed:?}");
    assert!(
        t_killed.error.as_deref().unwrap_or("").contains("step 4"),
        "{t_killed:?}"
    );
    let t_next = transfer_of(&p, &next).await;
    let done = wait_published(&p, t_next.id).await;
    same_tree(&next, Path::new(done.local_path.as_deref().unwrap()));
}
