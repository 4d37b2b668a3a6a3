//! Restart the source agent with a full queue: classes, importance
//! overrides, signal promotions and severities, pauses and the sink's
//! verified progress come back from the catalog, and the queue then
//! drains (the paused transfer only once resumed).
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{published_by, same_tree, write_dir, Restartable};
use ferry_catalog::Transfer;
use ferry_proto::state::{TransferId, TransferState};
use replicator::sink::Resolution;
use replicator::source::{RootConfig, Source};
use scheduler::Class;

/// Link rate cap before the restart, bit/s (2 MB/s): the queue cannot
/// drain before the source is stopped.
const SLOW: u64 = 16_000_000;
/// Chunk size: progress at the sink comes in chunks of this size.
const CHUNK: u32 = 256 << 10;

async fn row(s: &Source, id: TransferId) -> Transfer {
    s.catalog().transfer(id).await.unwrap().unwrap()
}

/// Waits (at most 10 s) until `ok` holds for transfer `id`'s row.
async fn until(s: &Source, id: TransferId, what: &str, ok: impl Fn(&Transfer) -> bool) -> Transfer {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let t = row(s, id).await;
        if ok(&t) {
            return t;
        }
        assert!(Instant::now() < deadline, "transfer {id}: {what}: {t:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Bytes the sink has verified of the checkpoint at `path`, if it is
/// receiving it.
async fn verified_at_sink(r: &Restartable, path: &Path) -> Option<u64> {
    match r.sink.resolve(path.to_str().unwrap()).await.unwrap() {
        Resolution::Replicating { bytes_done, .. } => Some(bytes_done),
        _ => None,
    }
}

/// What must come back after the restart.
fn kept(t: &Transfer) -> impl PartialEq + std::fmt::Debug {
    (
        t.id,
        t.class,
        t.importance,
        t.urgent_until,
        t.signal,
        t.job.clone(),
        t.link.clone(),
        t.source_path.clone(),
        t.created_at,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_the_source_agent_with_a_full_queue_classes_scores_progress_come_back() {
    let mut archive = PathBuf::new();
    let r = Restartable::new(|cfg| {
        let base = cfg.roots[0].path.parent().unwrap().parent().unwrap();
        archive = base.join("archive");
        std::fs::create_dir_all(&archive).unwrap();
        archive = std::fs::canonicalize(&archive).unwrap();
        cfg.roots.push(RootConfig {
            path: archive.clone(),
            job: "archive".into(),
            link: "l".into(),
            watch: Default::default(),
        });
        cfg.links[0].rate_bps = SLOW;
        cfg.chunk_size = CHUNK;
    })
    .await;
    let plain_dir = r.root.join("step-1");
    let important_dir = r.root.join("step-2");
    let urgent_dir = r.root.join("step-3");
    let logs_dir = archive.join("logs");
    let paused_dir = archive.join("dataset");
    // The urgent checkpoint is the largest: it gets most of the link and
    // must still be moving when the source stops.
    write_dir(&urgent_dir, 4, 2 << 20);
    for d in [&plain_dir, &important_dir, &logs_dir, &paused_dir] {
        write_dir(d, 2, 1 << 20);
    }

    let src = r.start_source(r.cfg.clone()).await;
    let plain = src.submit(&plain_dir, None).await.unwrap().id;
    let important = src.submit(&important_dir, None).await.unwrap().id;
    let logs = src
        .submit_as(&logs_dir, None, Class::Background)
        .await
        .unwrap()
        .id;
    let paused = src
        .submit_as(&paused_dir, None, Class::Background)
        .await
        .unwrap()
        .id;
    let urgent = src.submit(&urgent_dir, None).await.unwrap().id;

    let t = src
        .reprioritise(important, None, Some(Some(0.9)))
        .await
        .unwrap();
    assert_eq!(t.importance, Some(0.9));
    let out = src
        .signal("job", "loss_spike", 0.9, Some(3), Some("spike-3"))
        .await
        .unwrap();
    assert_eq!(out.promoted, Some(urgent), "the job's newest checkpoint");
    let until_ms = out.urgent_until.unwrap();
    // Paused once it moves (a pause as the transfer starts: operator.rs).
    until(&src, paused, "becomes active", |t| {
        t.state == TransferState::Active
    })
    .await;
    let t = src.pause(paused).await.unwrap();
    assert_eq!(t.state, TransferState::Paused);

    // Progress: the sink has verified part of the urgent checkpoint, and
    // the source has heard so (it counts a batch once the sink confirms
    // it whole; the sink records each chunk as it verifies it).
    let deadline = Instant::now() + Duration::from_secs(10);
    let (done_before, known_before) = loop {
        let at_sink = verified_at_sink(&r, &urgent_dir).await;
        let (live, _) = src.with_progress(row(&src, urgent).await);
        match at_sink {
            Some(d) if live.bytes_done as u64 >= 2 * u64::from(CHUNK) => {
                break (d, live.bytes_done);
            }
            other => assert!(
                Instant::now() < deadline,
                "the sink verified {other:?} bytes of {}, the source knows of {}",
                urgent_dir.display(),
                live.bytes_done
            ),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let ids = [plain, important, logs, paused, urgent];
    let mut before = Vec::new();
    for id in ids {
        before.push(row(&src, id).await);
    }
    for t in &before {
        assert!(
            !t.state.is_final(),
            "transfer {} finished before the restart: {t:?}",
            t.id
        );
    }

    src.shutdown(Duration::from_secs(5)).await;
    // What the stopped run achieved is in the catalog: at least what the
    // source knew the sink had, and at least what the sink verified as
    // sent (it can only verify what was sent). Chunks of a batch whose
    // confirmation was still on its way may be missing from `bytes_done`:
    // the next run asks the sink and skips them.
    let stopped = row(&src, urgent).await;
    assert!(
        stopped.bytes_done >= known_before && stopped.bytes_sent as u64 >= done_before,
        "the source's catalog lost what it sent before stopping: {stopped:?}, the source knew of {known_before}, the sink verified {done_before}"
    );
    drop(src);
    let t0 = Instant::now();
    // The same catalog directory, now at full speed.
    let mut cfg = r.cfg.clone();
    cfg.links[0].rate_bps = 1_000_000_000;
    let src = r.start_source(cfg).await;

    // The rows come back as they were: classes, importance override,
    // promotion and its signal; the pause holds.
    for b in &before {
        let a = row(&src, b.id).await;
        assert_eq!(kept(&a), kept(b), "transfer {} after the restart", b.id);
    }
    assert_eq!(row(&src, logs).await.class, Class::Background);
    assert_eq!(row(&src, paused).await.class, Class::Background);
    assert_eq!(row(&src, plain).await.class, Class::Scheduled);
    assert_eq!(row(&src, important).await.importance, Some(0.9));
    let u = row(&src, urgent).await;
    assert_eq!(
        (u.class, u.urgent_until),
        (Class::Scheduled, Some(until_ms))
    );
    assert_eq!(u.signal, Some(out.signal.id));
    assert_eq!(row(&src, paused).await.state, TransferState::Paused);

    // Scores: the promotion and the job's live severity are back in the
    // link's scheduler (loaded when its worker starts), the override in
    // the importance term.
    let deadline = Instant::now() + Duration::from_secs(2);
    let ranking = loop {
        let k = src.ranking(&row(&src, urgent).await).await.unwrap();
        if k.severity > 0.0 || Instant::now() >= deadline {
            break k;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(ranking.class, Class::Urgent, "{ranking:?}");
    assert_eq!(ranking.promoted_until, Some(until_ms));
    assert!(
        (0.85..=0.9).contains(&ranking.severity),
        "the loss spike's severity after the restart: {ranking:?}"
    );
    let w = src.policy().weights;
    let sev_term = 1.0 + w.severity * ranking.severity;
    assert!(
        (ranking.score.severity - sev_term).abs() < 1e-9,
        "{ranking:?}"
    );
    let k = src.ranking(&row(&src, important).await).await.unwrap();
    assert_eq!((k.class, k.importance_from), (Class::Scheduled, "transfer"));
    assert!(
        (k.score.importance - (1.0 + w.importance * 0.9)).abs() < 1e-9,
        "{k:?}"
    );
    assert!(k.severity > 0.85, "same job, same severity: {k:?}");
    let k = src.ranking(&row(&src, logs).await).await.unwrap();
    assert_eq!((k.class, k.severity), (Class::Background, 0.0), "{k:?}");
    // The signal's idempotency key is remembered too.
    let again = src
        .signal("job", "loss_spike", 0.9, Some(3), Some("spike-3"))
        .await
        .unwrap();
    assert!(!again.new);
    assert_eq!(again.signal.id, out.signal.id);
    assert_eq!(again.promoted, Some(urgent));

    // The queue drains; the urgent checkpoint resumes where the sink left
    // off instead of starting over.
    for id in [urgent, plain, important, logs] {
        published_by(&src, id).await;
    }
    let m = row(&src, urgent).await;
    // `bytes_sent` counts every run.
    let after = m.bytes_sent - stopped.bytes_sent;
    assert!(
        after > 0 && (after as u64) <= m.bytes_total as u64 - done_before,
        "after the restart the source sent {after} of {} bytes although the sink had verified {done_before}",
        m.bytes_total
    );
    let p = row(&src, paused).await;
    assert_eq!(
        p.state,
        TransferState::Paused,
        "a paused transfer stays paused: {p:?}"
    );
    assert!(
        !matches!(
            r.sink.resolve(paused_dir.to_str().unwrap()).await.unwrap(),
            Resolution::Local { .. }
        ),
        "the paused checkpoint was published"
    );
    let t = src.resume(paused).await.unwrap();
    assert_eq!(t.state, TransferState::Queued);
    published_by(&src, paused).await;
    for (id, dir) in [
        (urgent, &urgent_dir),
        (plain, &plain_dir),
        (important, &important_dir),
        (logs, &logs_dir),
        (paused, &paused_dir),
    ] {
        let t = row(&src, id).await;
        same_tree(dir, Path::new(t.local_path.as_deref().unwrap()));
    }
    eprintln!("drained {:?} after the restart", t0.elapsed());
    src.shutdown(Duration::from_secs(5)).await;
}
