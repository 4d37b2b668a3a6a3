//! The scheduler on a real (in-memory, emulated) link: with lower-class
//! transfers filling the link's rate cap, a loss-spike signal makes a
//! checkpoint urgent and its bytes reach the sink first; under `fifo` it
//! waits its turn. Checked from the chunk arrival times the sink's
//! catalog records, not from wall-clock speed.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{pair_with, wait_published, Pair};
use rand::RngCore;
use replicator::source::RootConfig;
use scheduler::{Class, Policy, PolicyKind};

/// Link rate cap for these tests, bit/s (the emulated path is faster, so
/// the scheduler's cap is what the transfers share).
const RATE: u64 = 100_000_000;

fn write_dir(dir: &Path, files: usize, size: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let mut rng = rand::thread_rng();
    for i in 0..files {
        let mut b = vec![0u8; size];
        rng.fill_bytes(&mut b);
        std::fs::write(dir.join(format!("shard-{i}.bin")), b).unwrap();
    }
}

async fn pair_for(kind: PolicyKind) -> (Pair, PathBuf, PathBuf) {
    let mut other = PathBuf::new();
    let mut data = PathBuf::new();
    let p = pair_with(0, |cfg| {
        let base = cfg.roots[0]
            .path
            .parent()
            .unwrap()
            .parent()
            .unwrap()
            .to_path_buf();
        other = base.join("ckpt").join("other");
        data = base.join("data");
        for d in [&other, &data] {
            std::fs::create_dir_all(d).unwrap();
        }
        other = std::fs::canonicalize(&other).unwrap();
        data = std::fs::canonicalize(&data).unwrap();
        cfg.roots.push(RootConfig {
            path: other.clone(),
            job: "other".into(),
            link: "l".into(),
            watch: Default::default(),
        });
        cfg.roots.push(RootConfig {
            path: data.clone(),
            job: "archive".into(),
            link: "l".into(),
            watch: Default::default(),
        });
        cfg.links[0].rate_bps = RATE;
        cfg.chunk_size = 512 << 10;
        cfg.policy = Policy {
            kind,
            ..Policy::default()
        };
    })
    .await;
    (p, other, data)
}

/// Queues the load: three background copies and two checkpoints of
/// another job, 8 MB each; returns their ids once bytes are moving.
async fn start_load(p: &Pair, other: &Path, data: &Path) -> Vec<i64> {
    // Everything is written first, so the load starts together.
    let sets: Vec<PathBuf> = (0..3).map(|i| data.join(format!("set-{i}"))).collect();
    let steps: Vec<PathBuf> = (0..2).map(|i| other.join(format!("step-{i}"))).collect();
    for d in sets.iter().chain(&steps) {
        write_dir(d, 4, 2 << 20);
    }
    write_dir(&p.root.join("step-100"), 6, 2 << 20);
    let mut ids = Vec::new();
    for d in &sets {
        ids.push(
            p.source
                .submit_as(d, None, Class::Background)
                .await
                .unwrap()
                .id,
        );
    }
    for d in &steps {
        ids.push(p.source.submit(d, None).await.unwrap().id);
    }
    for _ in 0..400 {
        let sent: u64 = ids
            .iter()
            .filter_map(|id| p.source.progress(*id))
            .map(|g| g.bytes_sent)
            .sum();
        if std::env::var("FERRY_TEST_DEBUG").is_ok() {
            let v: Vec<_> = ids
                .iter()
                .map(|id| p.source.progress(*id).map(|g| g.bytes_sent))
                .collect();
            eprintln!("progress {v:?}");
        }
        if sent >= 4 << 20 {
            return ids;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the load never started moving");
}

/// Sink-side arrivals `(100 ms window start, bytes)` of the replica of
/// source transfer `id`.
async fn arrivals(p: &Pair, id: i64) -> Vec<(i64, u64)> {
    let reps = p.sink.catalog().replicas(false, 100, 0).await.unwrap();
    let r = reps
        .iter()
        .find(|r| r.source_transfer == id)
        .unwrap_or_else(|| panic!("no replica of transfer {id} at the sink"));
    p.sink.catalog().chunk_arrivals(r.id).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loss_spike_makes_a_checkpoint_urgent_and_its_bytes_go_first() {
    let (p, other, data) = pair_for(PolicyKind::Priority).await;
    let load = start_load(&p, &other, &data).await;
    let ckpt = p.root.join("step-100");
    let t = p.source.submit(&ckpt, None).await.unwrap();

    let out = p
        .source
        .signal("job", "loss_spike", 0.9, Some(100), Some("spike-100"))
        .await
        .unwrap();
    assert!(out.new);
    assert_eq!(
        out.promoted,
        Some(t.id),
        "the newest checkpoint is promoted"
    );
    // Whole 100 ms arrival windows after the one the signal came in.
    let w = replicator::catalog::ARRIVAL_WINDOW_MS;
    let since = (out.signal.received_at / w + 1) * w;
    let again = p
        .source
        .signal("job", "loss_spike", 0.9, Some(100), Some("spike-100"))
        .await
        .unwrap();
    assert!(!again.new, "a repeated idempotency key changes nothing");
    assert_eq!(again.signal.id, out.signal.id);

    let row = p.source.catalog().transfer(t.id).await.unwrap().unwrap();
    let ranking = p.source.ranking(&row).await.unwrap();
    assert_eq!(ranking.class, Class::Urgent);
    assert!(ranking.severity > 0.8, "{ranking:?}");

    let done = wait_published(&p, t.id).await;
    // From the first whole window after the signal to the window of the
    // checkpoint's last byte (verification and publish send nothing).
    let urgent = arrivals(&p, t.id).await;
    let last = urgent.last().unwrap().0;
    let mine: u64 = urgent
        .iter()
        .filter(|(at, _)| (since..=last).contains(at))
        .map(|a| a.1)
        .sum();
    let mut theirs = 0u64;
    for id in &load {
        theirs += arrivals(&p, *id)
            .await
            .iter()
            .filter(|(at, _)| (since..=last).contains(at))
            .map(|a| a.1)
            .sum::<u64>();
    }
    let until = done.finished_at.unwrap();
    let share = mine as f64 / (mine + theirs) as f64;
    eprintln!("urgent share after the signal: {share:.3}");
    if std::env::var("FERRY_TEST_DEBUG").is_ok() {
        eprintln!("signal window {since}, publish {until}");
        eprintln!("urgent: {:?}", arrivals(&p, t.id).await);
        for id in &load {
            eprintln!("{id}: {:?}", arrivals(&p, *id).await);
        }
    }
    // The floors leave urgent 85 % while both lower classes are busy.
    assert!(
        share >= 0.7,
        "urgent bytes were {share:.2} of what reached the sink between the signal and its publish"
    );
    let mut still_moving = 0;
    for id in &load {
        let l = p.source.catalog().transfer(*id).await.unwrap().unwrap();
        if l.state != "published" || l.finished_at.unwrap() > until {
            still_moving += 1;
        }
    }
    assert!(
        still_moving >= 3,
        "the load should still be moving when the urgent checkpoint is published"
    );
    for id in load {
        wait_published(&p, id).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_fifo_the_signal_changes_nothing_and_the_checkpoint_waits_its_turn() {
    let (p, other, data) = pair_for(PolicyKind::Fifo).await;
    let load = start_load(&p, &other, &data).await;
    let ckpt = p.root.join("step-100");
    let t = p.source.submit(&ckpt, None).await.unwrap();
    let out = p
        .source
        .signal("job", "loss_spike", 0.9, Some(100), None)
        .await
        .unwrap();
    assert_eq!(out.promoted, Some(t.id), "the class is still recorded");
    let done = wait_published(&p, t.id).await;
    let first_byte = arrivals(&p, t.id).await.first().unwrap().0;
    for id in load {
        let l = wait_published(&p, id).await;
        assert!(
            l.finished_at.unwrap() <= done.finished_at.unwrap(),
            "transfer {id} (older) finished after the checkpoint under fifo"
        );
        let last = arrivals(&p, id).await.last().unwrap().0;
        assert!(
            last <= first_byte + replicator::catalog::ARRIVAL_WINDOW_MS,
            "transfer {id} (older) still sent at {last} after the checkpoint's first byte at {first_byte}"
        );
    }
}
