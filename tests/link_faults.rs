//! Link faults with real `ferry` processes (issue 7): a link cut longer
//! than the QUIC idle timeout and then restored, and random loss,
//! reordering and duplicated datagrams injected by the `ferry link-emu`
//! relay between the source and the sink, with fixed seeds. Every case
//! ends with a byte-identical replica, and checks from the relay's own
//! counters that the faults were really injected. They assert behaviour,
//! never speed; the bounds are generous for a loaded 2-core machine.
//!
//! `FERRY_LINK_ROUNDS` repeats each loss, reordering and duplication case
//! with new seeds, and `FERRY_LINK_SEED` moves every seed (a soak:
//! `FERRY_LINK_ROUNDS=10 FERRY_LINK_SEED=$RANDOM cargo test -p ferry --test
//! link_faults -- --nocapture`).

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use replicator::transport::IDLE_TIMEOUT;
use serde_json::Value;

use common::*;

/// Bound for a transfer that should simply complete.
const TRANSFER: Duration = Duration::from_secs(180);
/// Bound for the relay to act on a signal or to stop.
const RELAY: Duration = Duration::from_secs(15);
/// Rate cap of the loss, reordering and duplication cases.
const RATE: &str = "100Mbit/s";
/// Size of their checkpoint (`ferry gen`: a few large tensors, many small
/// ones).
const SIZE: &str = "6MB";

/// One direction's counters from `ferry link-emu`'s last line.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    delivered: u64,
    queue: u64,
    loss: u64,
    cut: u64,
    duplicated: u64,
    reordered: u64,
}

impl Counts {
    /// Datagrams the relay received (copies it made not included).
    fn offered(&self) -> u64 {
        self.delivered - self.duplicated + self.queue + self.loss + self.cut
    }

    /// `n` as a fraction of the datagrams offered.
    fn share(&self, n: u64) -> f64 {
        n as f64 / self.offered().max(1) as f64
    }
}

/// Parses the relay's final line, `up: N packets, N dropped by queue, N
/// by loss, N by cut, N duplicated, N reordered, N corrupted; down: ...`.
fn relay_counts(w: &World, stdout: &str) -> (Counts, Counts) {
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with("up: "))
        .unwrap_or_else(|| w.fail(format!("no counters in the relay's output:\n{stdout}")));
    let parse = |part: &str| -> Counts {
        let mut by: HashMap<String, u64> = HashMap::new();
        for item in part.split(", ") {
            let (n, label) = item
                .split_once(' ')
                .unwrap_or_else(|| w.fail(format!("relay counters: {line:?}")));
            let n = n
                .parse()
                .unwrap_or_else(|_| w.fail(format!("relay counters: {line:?}")));
            by.insert(label.to_string(), n);
        }
        let get = |label: &str| {
            *by.get(label)
                .unwrap_or_else(|| w.fail(format!("no {label:?} in the relay's {line:?}")))
        };
        Counts {
            delivered: get("packets"),
            queue: get("dropped by queue"),
            loss: get("by loss"),
            cut: get("by cut"),
            duplicated: get("duplicated"),
            reordered: get("reordered"),
        }
    };
    let (up, down) = line
        .strip_prefix("up: ")
        .and_then(|l| l.split_once("; down: "))
        .unwrap_or_else(|| w.fail(format!("relay counters: {line:?}")));
    (parse(up), parse(down))
}

/// How many lines of `text` contain `needle`.
fn count(text: &str, needle: &str) -> usize {
    text.lines().filter(|l| l.contains(needle)).count()
}

/// `v[key]` as an integer, or 0.
fn int(v: &Value, key: &str) -> u64 {
    v[key].as_u64().unwrap_or(0)
}

/// The sink's `ferry_verification_failures_total`, 0 if absent.
async fn verification_failures(w: &World, sink: &Agent) -> f64 {
    metric(
        &scrape(w, sink).await,
        "ferry_verification_failures_total",
        &[],
    )
    .unwrap_or(0.0)
}

/// Rounds of each loss, reordering and duplication case: 1 unless
/// `FERRY_LINK_ROUNDS` says otherwise (a soak).
fn rounds() -> u64 {
    env_number("FERRY_LINK_ROUNDS").unwrap_or(1).max(1)
}

/// The relay seed of `round` of a case whose fixed seed is `fixed`:
/// `fixed` in the first round unless `FERRY_LINK_SEED` is set, which then
/// replaces the fixed seeds (each case adds its own fixed seed to it).
fn seed(fixed: u64, round: u64) -> u64 {
    let base = env_number("FERRY_LINK_SEED").map_or(fixed, |s| s.wrapping_add(fixed));
    base.wrapping_add(round * 1000)
}

fn env_number(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?} is not a number: {e}")),
    )
}

/// Sends `sig` to the relay and waits until it printed its `n`-th line
/// containing `says`.
async fn signal_relay(w: &World, relay: &Relay, sig: Signal, says: &str, n: usize) {
    relay.signal(sig);
    w.wait_until(&format!("the relay to print {says:?}"), RELAY, async || {
        let out = relay.stdout();
        if count(&out, says) >= n {
            Ok(())
        } else {
            Err(out)
        }
    })
    .await;
}

/// [`replicate_once`] for each of [`rounds`], the relay seeded from
/// `fixed_seed` (see [`seed`]).
async fn replicate_through(
    name: &str,
    relay_args: &[&str],
    fixed_seed: u64,
    check: impl Fn(&Counts, &Counts) -> Result<(), String>,
) {
    for round in 0..rounds() {
        let seed = seed(fixed_seed, round).to_string();
        let mut args = relay_args.to_vec();
        args.extend(["--seed", seed.as_str()]);
        replicate_once(name, &args, &check).await;
    }
}

/// Replicates a generated checkpoint through a relay with `relay_args`
/// and checks the replica is byte-identical, `ferry verify` passes and no
/// chunk failed verification at the sink; then stops the relay and hands
/// its counters (up: source to sink, down: back) to `check`.
async fn replicate_once(
    name: &str,
    relay_args: &[&str],
    check: &impl Fn(&Counts, &Counts) -> Result<(), String>,
) {
    let w = World::new(name).await;
    let rel = "step_000100";
    let ckpt = w.source_root().join(rel);
    w.gen(&ckpt, SIZE).await;
    let files = files_under(&ckpt).len();
    let mut c = w.start_cluster_with(RATE, relay_args, &[], |_, _| {}).await;
    let started = Instant::now();
    let out = w.push(&c.source, &ckpt, &[]).await;
    let took = started.elapsed();
    w.ensure(out.success(), || format!("ferry push failed: {out}"));
    let replica = w.replica_path(rel);
    w.assert_same_tree(&ckpt, &replica);
    let v = w.verify(&c.sink, &replica).await;
    w.ensure(v.success(), || format!("ferry verify failed: {v}"));
    let failures = verification_failures(&w, &c.sink).await;
    w.ensure(failures == 0.0, || {
        format!("{failures} chunks failed verification at the sink")
    });
    let stdout = c
        .relay_mut()
        .stop(RELAY)
        .unwrap_or_else(|| w.fail("the relay did not stop within 15 s of SIGTERM"));
    let (up, down) = relay_counts(&w, &stdout);
    eprintln!(
        "{name}: {} bytes in {files} files replicated in {:.1} s through link-emu {}; \
         up {up:?}; down {down:?}",
        tree_bytes(&ckpt),
        took.as_secs_f64(),
        relay_args.join(" ")
    );
    if let Err(e) = check(&up, &down) {
        w.fail(format!(
            "{name}: the relay did not inject what it should: {e}\nup {up:?}\ndown {down:?}"
        ));
    }
}

/// `Err` naming `what` unless `share` is within `range`.
fn within(what: &str, share: f64, range: std::ops::Range<f64>) -> Result<(), String> {
    if range.contains(&share) {
        Ok(())
    } else {
        Err(format!(
            "{what} is {:.2} % of the datagrams, expected {:.1} % to {:.1} %",
            share * 100.0,
            range.start * 100.0,
            range.end * 100.0
        ))
    }
}

#[tokio::test]
async fn one_percent_loss() {
    replicate_through("loss1", &["--loss", "0.01"], 101, |up, _| {
        // About 450 datagrams go back: too few to bound their loss share.
        within("up loss", up.share(up.loss), 0.004..0.02)
    })
    .await;
}

#[tokio::test]
async fn five_percent_loss() {
    replicate_through("loss5", &["--loss", "0.05"], 105, |up, down| {
        within("up loss", up.share(up.loss), 0.035..0.065)?;
        // About 500 datagrams go back: a wide bound.
        within("down loss", down.share(down.loss), 0.01..0.1)
    })
    .await;
}

#[tokio::test]
async fn jitter_reorders_datagrams() {
    // 10 ms +- 5 ms one way: datagrams a few hundred microseconds apart
    // overtake each other.
    let args = ["--jitter", "5ms", "--reorder"];
    replicate_through("reorder", &args, 107, |up, _| {
        within("up reordered", up.share(up.reordered), 0.05..1.0)?;
        if up.loss + up.duplicated != 0 {
            return Err("loss or duplication without asking for it".into());
        }
        Ok(())
    })
    .await;
}

#[tokio::test]
async fn duplicated_and_reordered_datagrams() {
    let args = ["--duplicate", "0.03", "--jitter", "3ms", "--reorder"];
    replicate_through("duplicate", &args, 109, |up, down| {
        within("up duplicated", up.share(up.duplicated), 0.015..0.045)?;
        if down.duplicated == 0 {
            return Err("no datagram duplicated towards the source".into());
        }
        within("up reordered", up.share(up.reordered), 0.01..1.0)
    })
    .await;
}

/// The sink's view of `ckpt`: its resolve state and verified bytes.
async fn sink_progress(w: &World, sink: &Agent, ckpt: &Path) -> Result<(String, u64, u64), String> {
    let r = w.try_resolve(sink, ckpt).await?;
    Ok((
        s(&r, "state").to_string(),
        int(&r, "bytes_done"),
        int(&r, "bytes_total"),
    ))
}

/// A cut of the link longer than the QUIC idle timeout
/// ([`IDLE_TIMEOUT`], 10 s): the source gives the connection up, keeps
/// the transfer unpublished, reconnects once the link is back and
/// resumes where the sink is, publishing a byte-identical replica.
#[tokio::test]
async fn link_cut_longer_than_the_idle_timeout_then_restored() {
    /// How long the link stays cut past the idle timeout.
    const PAST_IDLE: Duration = Duration::from_secs(5);
    let w = World::new("linkcut").await;
    let rel = "step_000500";
    let ckpt = w.source_root().join(rel);
    w.gen(&ckpt, "30MB").await;
    let total = tree_bytes(&ckpt);
    // 24 Mbit/s: about 3 MB/s, so the checkpoint takes about 10 s.
    let c = w.start_cluster("24Mbit/s", &[], |_, _| {}).await;
    let (source, sink, relay) = (&c.source, &c.sink, c.relay());
    let id = w.push_no_wait(source, &ckpt).await;

    let done_before = w
        .wait_until(
            "the sink to verify 10 % of the checkpoint",
            TRANSFER,
            async || {
                let (state, done, total) = sink_progress(&w, sink, &ckpt).await?;
                if state == "replicating" && total > 0 && done * 10 >= total {
                    Ok(done)
                } else {
                    Err(format!("{state}: {done} of {total} bytes"))
                }
            },
        )
        .await;
    w.ensure(done_before < total, || {
        format!("the transfer finished before the cut ({done_before} of {total} bytes)")
    });
    let log = source.stderr();
    let connected = count(&log, "connected to sink");
    let interrupted = count(&log, "transfer interrupted");
    w.ensure(connected == 1 && interrupted == 0, || {
        format!("before the cut: {connected} connections, {interrupted} interruptions")
    });

    signal_relay(&w, relay, Signal::SIGUSR1, "link-emu: link cut", 1).await;
    let cut_at = Instant::now();
    // Nothing reaches the source: it notices when the idle timeout ends
    // the connection, not before.
    w.wait_until(
        "the source to give the connection up",
        IDLE_TIMEOUT + Duration::from_secs(30),
        async || {
            let n = count(&source.stderr(), "transfer interrupted");
            if n > interrupted {
                Ok(())
            } else {
                Err(format!("{:?} after the cut", cut_at.elapsed()))
            }
        },
    )
    .await;
    let noticed = cut_at.elapsed();
    w.ensure(noticed + Duration::from_secs(2) >= IDLE_TIMEOUT, || {
        format!("the source gave the connection up {noticed:?} after the cut, before the {IDLE_TIMEOUT:?} idle timeout")
    });
    let t = w.transfer(source, id).await;
    w.ensure(
        s(&t, "state") != "published" && t["progress"].is_null(),
        || format!("with the link cut the transfer should be unpublished and not running: {t}"),
    );
    let (state, _, _) = sink_progress(&w, sink, &ckpt)
        .await
        .unwrap_or_else(|e| w.fail(e));
    w.ensure(state == "replicating", || {
        format!("with the link cut the sink should say replicating, not {state}")
    });

    // Stay cut well past the idle timeout.
    tokio::time::sleep_until((cut_at + IDLE_TIMEOUT + PAST_IDLE).into()).await;
    let t = w.transfer(source, id).await;
    w.ensure(s(&t, "state") != "published", || {
        format!("published while the link was cut: {t}")
    });
    let sent_at_restore = int(&t, "bytes_sent");
    let cut_for = cut_at.elapsed();
    signal_relay(&w, relay, Signal::SIGUSR2, "link-emu: link restored", 1).await;
    let restored_at = Instant::now();

    w.wait_until("the source to reconnect", TRANSFER, async || {
        let n = count(&source.stderr(), "connected to sink");
        if n > connected {
            Ok(())
        } else {
            Err(format!("{n} connections so far"))
        }
    })
    .await;
    let reconnected = restored_at.elapsed();

    // The sink's verified bytes never fall below what it had before the
    // cut: the transfer resumes, it does not start over.
    let mut least_done = u64::MAX;
    let t = w
        .wait_until("the transfer to be published", TRANSFER, async || {
            if let Ok((state, done, _)) = sink_progress(&w, sink, &ckpt).await {
                if state == "replicating" {
                    least_done = least_done.min(done);
                }
            }
            let t = w.transfer(source, id).await;
            match s(&t, "state") {
                "published" => Ok(t),
                "failed" | "cancelled" => w.fail(format!("transfer {id} ended: {t}")),
                _ => Err(t.to_string()),
            }
        })
        .await;
    let published = restored_at.elapsed();
    w.ensure(least_done == u64::MAX || least_done >= done_before, || {
        format!(
            "after the restore the sink reported {least_done} verified bytes, fewer than the \
             {done_before} it had before the cut"
        )
    });
    let sent_after = int(&t, "bytes_sent").saturating_sub(sent_at_restore);
    // Starting over would send everything again.
    w.ensure(sent_after <= total - done_before / 2, || {
        format!(
            "after the restore the source sent {sent_after} of {total} bytes although the sink \
             held {done_before}: it started over: {t}"
        )
    });
    w.assert_same_tree(&ckpt, &w.replica_path(rel));
    let r = w.resolve(sink, &ckpt).await;
    w.ensure(s(&r, "state") == "local", || {
        format!("resolve after the publish: {r}")
    });

    let stdout = {
        let mut c = c;
        c.relay_mut()
            .stop(RELAY)
            .unwrap_or_else(|| w.fail("the relay did not stop within 15 s of SIGTERM"))
    };
    let (up, down) = relay_counts(&w, &stdout);
    w.ensure(up.cut > 0, || {
        format!("the relay dropped nothing by the cut: up {up:?}, down {down:?}")
    });
    eprintln!(
        "link cut: the sink held {done_before} of {total} bytes at the cut; the source gave the \
         connection up after {:.1} s; cut for {:.1} s; reconnected {:.1} s after the restore, \
         published {:.1} s after it, sending {sent_after} bytes after the restore; the sink \
         reported at least {least_done} bytes meanwhile; dropped by cut: {} up, {} down",
        noticed.as_secs_f64(),
        cut_for.as_secs_f64(),
        reconnected.as_secs_f64(),
        published.as_secs_f64(),
        up.cut,
        down.cut
    );
}
