//! Operator pause and cancel hold, also when they land while the link
//! worker is starting the transfer: the transfer task's own state writes
//! (active, verifying) must not undo them.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::time::Duration;

use common::pair_with;
use replicator::sink::Resolution;

/// Link rate cap, bit/s (2 MB/s): a 1 MB checkpoint takes about half a
/// second, so the sink cannot publish one right after it is stopped.
const SLOW: u64 = 16_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_cancel_right_after_submit_hold() {
    let p = pair_with(0, |cfg| cfg.links[0].rate_bps = SLOW).await;
    let mut undone = Vec::new();
    for i in 0..16u64 {
        let dir = p.root.join(format!("step-{i}"));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("shard.bin"), vec![i as u8; 1 << 20]).unwrap();
        let t = p.source.submit(&dir, None).await.unwrap();
        // From before the link worker admits it to after it started.
        tokio::time::sleep(Duration::from_micros(i * 250)).await;
        let cancel = i % 2 == 1;
        let asked = if cancel { "cancelled" } else { "paused" };
        let got = if cancel {
            p.source.cancel(t.id).await.unwrap()
        } else {
            p.source.pause(t.id).await.unwrap()
        };
        if got.state != asked {
            undone.push(format!("{asked} transfer {}: answered {}", t.id, got.state));
            continue;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = p.source.catalog().transfer(t.id).await.unwrap().unwrap();
        if now.state != asked {
            undone.push(format!(
                "{asked} transfer {}: {} 300 ms later",
                t.id, now.state
            ));
        }
    }
    // Nothing stopped was published at the sink either.
    for i in 0..16u64 {
        let dir = p.root.join(format!("step-{i}"));
        let r = p.sink.resolve(dir.to_str().unwrap()).await.unwrap();
        if matches!(r, Resolution::Local { .. }) {
            undone.push(format!("{} published at the sink", dir.display()));
        }
    }
    assert!(undone.is_empty(), "{undone:#?}");
}
