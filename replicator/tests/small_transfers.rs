//! Small transfers in bulk: a burst of a thousand tiny pushes all publish,
//! each byte-identical, and they move many at once, not `max_active` at a
//! time (`[scheduler] small_transfer`, `max_small_active`).
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::time::Duration;

use ferry_proto::state::TransferState;
use replicator::sink::Resolution;

/// Transfers in the burst.
const N: usize = 1000;
/// Bytes per transfer (one file each).
const SIZE: usize = 4096;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_small_transfers_all_publish_byte_identical() {
    let p = common::pair(0).await;
    let max_active = p.source.policy().max_active as i64;
    let mut dirs = Vec::with_capacity(N);
    for i in 0..N {
        let dir = p.root.join(format!("small-{i:04}"));
        common::write_dir(&dir, 1, SIZE);
        dirs.push(dir);
    }
    let mut ids = Vec::with_capacity(N);
    for d in &dirs {
        ids.push(p.source.submit(d, None).await.unwrap().id);
    }
    // Until every one is final (at most 10 minutes on a loaded machine),
    // the most that were moving at once.
    let mut most_active = 0;
    let mut done = false;
    for _ in 0..6000 {
        let counts = p.source.catalog().transfer_state_counts().await.unwrap();
        let count = |s: TransferState| {
            counts
                .iter()
                .find(|(st, _)| *st == s)
                .map_or(0, |(_, n)| *n)
        };
        most_active =
            most_active.max(count(TransferState::Active) + count(TransferState::Verifying));
        let finished = count(TransferState::Published)
            + count(TransferState::Failed)
            + count(TransferState::Cancelled);
        if finished == N as i64 {
            done = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(done, "not all {N} transfers finished within 10 minutes");
    for (id, dir) in ids.iter().zip(&dirs) {
        let t = p.source.catalog().transfer(*id).await.unwrap().unwrap();
        assert_eq!(t.state, TransferState::Published, "{t:?}");
        assert_eq!(t.bytes_total, SIZE as i64, "{t:?}");
        let Resolution::Local {
            local_path: Some(local_path),
            ..
        } = p.sink.resolve(dir.to_str().unwrap()).await.unwrap()
        else {
            panic!("{} not resolvable at the sink", dir.display());
        };
        common::same_tree(dir, std::path::Path::new(&local_path));
    }
    assert!(
        most_active > max_active,
        "at most {most_active} small transfers moved at once (max_active is {max_active})"
    );
}
