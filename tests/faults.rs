//! Fault-injection tests with real `ferry` processes (issue 7): SIGKILLs
//! of the sink and the source at seeded random points with an oracle over
//! the sink root after every kill, and a locked or corrupted catalog at
//! start. They assert behaviour, never speed.
//!
//! `FERRY_FAULT_SEED` and `FERRY_FAULT_KILLS` override the kill loop's
//! seed and number of kills (a soak: `FERRY_FAULT_KILLS=200 cargo test -p
//! ferry --test faults -- --nocapture sigkill`).

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use common::*;

/// Bound for a transfer that should simply complete.
const TRANSFER: Duration = Duration::from_secs(120);
/// The kill loop's seed unless `FERRY_FAULT_SEED` says otherwise.
const DEFAULT_SEED: u64 = 7_2025;
/// Kills per run unless `FERRY_FAULT_KILLS` says otherwise.
const DEFAULT_KILLS: u64 = 20;
/// Checkpoints the kill loop may push: 8, or 2 for every 5 kills when more
/// (so that a long soak keeps killing agents with transfers in flight).
fn pool(kills: u64) -> usize {
    (kills as usize * 2).div_ceil(5).max(8)
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?} is not a number: {e}")),
    )
}

/// One generated checkpoint of the kill loop.
struct Ckpt {
    rel: String,
    path: PathBuf,
    bytes: u64,
    /// The source's transfer id once pushed.
    id: Option<i64>,
}

/// The oracle over the sink root, run while nothing publishes (the sink
/// is dead) or retried for a publish in flight: everything outside the
/// hidden `.ferry` staging area is `<site>/<job>/<checkpoint>`, and every
/// such checkpoint directory is byte-identical (bytes, modes, mtimes) to
/// its source. Returns how many replicas it checked.
fn oracle_tree(w: &World, ckpts: &[Ckpt]) -> Result<usize, String> {
    let names = |d: &Path| -> Vec<String> {
        match fs::read_dir(d) {
            Ok(rd) => rd
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect(),
            Err(_) => Vec::new(),
        }
    };
    let root = w.sink_root();
    for n in names(&root) {
        if n != ".ferry" && n != SOURCE_SITE {
            return Err(format!("unexpected entry {n:?} in the sink root"));
        }
    }
    let site = root.join(SOURCE_SITE);
    for n in names(&site) {
        if n != JOB {
            return Err(format!("unexpected entry {n:?} in {}", site.display()));
        }
    }
    let job = site.join(JOB);
    let mut checked = 0;
    for n in names(&job) {
        let dir = job.join(&n);
        let Some(c) = ckpts.iter().find(|c| c.rel == n) else {
            return Err(format!(
                "{} is published but is no checkpoint of the source",
                dir.display()
            ));
        };
        tree_diff(&c.path, &dir)
            .map_err(|e| format!("PARTIAL replica published at {}: {e}", dir.display()))?;
        checked += 1;
    }
    Ok(checked)
}

/// The oracle over resolve: for every pushed checkpoint the sink answers
/// `local` for, the local path is the replica path and the replica is
/// complete. Returns how many answered `local`.
async fn oracle_resolve(w: &World, sink: &Agent, ckpts: &[Ckpt]) -> Result<usize, String> {
    let mut local = 0;
    for c in ckpts.iter().filter(|c| c.id.is_some()) {
        let r = w.try_resolve(sink, &c.path).await?;
        if s(&r, "state") != "local" {
            continue;
        }
        let lp = PathBuf::from(s(&r, "local_path"));
        let want = w.replica_path(&c.rel);
        if lp != want {
            return Err(format!(
                "resolve {}: local at {lp:?}, expected {want:?}: {r}",
                c.rel
            ));
        }
        tree_diff(&c.path, &lp).map_err(|e| {
            format!(
                "resolve answered local for an incomplete replica {}: {e}",
                c.rel
            )
        })?;
        local += 1;
    }
    Ok(local)
}

/// Bytes the sink holds verified for the pushed checkpoints (a published
/// one counts whole).
async fn sink_progress(w: &World, sink: &Agent, ckpts: &[Ckpt]) -> Result<u64, String> {
    let mut sum = 0;
    for c in ckpts.iter().filter(|c| c.id.is_some()) {
        let r = w.try_resolve(sink, &c.path).await?;
        sum += match s(&r, "state") {
            "local" => c.bytes,
            "replicating" => r["bytes_done"].as_u64().unwrap_or(0),
            _ => 0,
        };
    }
    Ok(sum)
}

/// Pushed transfers not yet published, per the source; fails the test on
/// a transfer that failed or was cancelled (a crash must never end one).
async fn unpublished(w: &World, source: &Agent, ctx: &str) -> usize {
    let ts = w.transfers(source).await;
    for t in &ts {
        if matches!(s(t, "state"), "failed" | "cancelled") {
            w.fail(format!("{ctx}: a transfer ended after a crash: {t}"));
        }
    }
    ts.iter().filter(|t| s(t, "state") != "published").count()
}

/// SIGKILL of the sink, then of the source, alternately, at seeded random
/// points while checkpoints replicate over a slow link; after every kill
/// the oracle checks the sink root and resolve. At the end every transfer
/// is published and byte-identical.
#[tokio::test]
async fn sigkill_loop_never_publishes_a_partial_replica() {
    let started = Instant::now();
    let seed = env_u64("FERRY_FAULT_SEED").unwrap_or(DEFAULT_SEED);
    let kills = env_u64("FERRY_FAULT_KILLS").unwrap_or(DEFAULT_KILLS);
    println!("sigkill loop: seed {seed}, {kills} kills (FERRY_FAULT_SEED, FERRY_FAULT_KILLS)");
    let mut rng = StdRng::seed_from_u64(seed);
    let w = World::new("sigkill").await;

    // Generated when first pushed, sizes from the seeded generator.
    let pool = pool(kills);
    let mut ckpts: Vec<Ckpt> = Vec::new();
    // 24 Mbit/s: about 3 MB/s, so each checkpoint takes seconds.
    let mut c = w.start_cluster("24Mbit/s", &[], |_, _| {}).await;

    let (mut sink_kills, mut source_kills, mut mid_transfer) = (0u64, 0u64, 0u64);
    let (mut tree_checks, mut replicas_checked, mut local_answers) = (0u64, 0u64, 0u64);
    let mut next = 0;
    let mut baseline = 0;
    for k in 0..kills {
        let ctx = format!("seed {seed}, kill {}", k + 1);
        // Keep two transfers in flight while checkpoints are left.
        while next < pool && unpublished(&w, &c.source, &ctx).await < 2 {
            let rel = format!("step_{:06}", (next + 1) * 100);
            let path = w.source_root().join(&rel);
            let mb: u32 = rng.gen_range(2..=12);
            w.gen(&path, &format!("{mb}MB")).await;
            let bytes = tree_bytes(&path);
            let id = Some(w.push_no_wait(&c.source, &path).await);
            ckpts.push(Ckpt {
                rel,
                path,
                bytes,
                id,
            });
            next += 1;
        }
        let sink_turn = k % 2 == 0;
        // The sink dies while chunks move; the source either while chunks
        // move or at any point (also while its connection to the dead sink
        // is timing out).
        if sink_turn || rng.gen_bool(0.5) {
            let (sink, ck) = (&c.sink, &ckpts);
            w.wait_until(&format!("{ctx}: chunks to move"), TRANSFER, async || {
                let p = sink_progress(&w, sink, ck).await?;
                let all_local = oracle_resolve(&w, sink, ck).await?
                    == ck.iter().filter(|c| c.id.is_some()).count();
                if p > baseline || all_local {
                    Ok(())
                } else {
                    Err(format!(
                        "{p} bytes verified, {baseline} after the last restart"
                    ))
                }
            })
            .await;
        }
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..1500))).await;
        if unpublished(&w, &c.source, &ctx).await > 0 {
            mid_transfer += 1;
        }
        let down = Duration::from_millis(rng.gen_range(0..800));
        if sink_turn {
            c.sink.kill();
            sink_kills += 1;
            // Nothing publishes while the sink is dead: no retry.
            match oracle_tree(&w, &ckpts) {
                Ok(n) => replicas_checked += n as u64,
                Err(e) => w.fail(format!("{ctx} (sink killed): {e}")),
            }
            tree_checks += 1;
            tokio::time::sleep(down).await;
            w.restart(&mut c.sink).await;
        } else {
            c.source.kill();
            source_kills += 1;
            tokio::time::sleep(down).await;
            w.restart(&mut c.source).await;
        }
        unpublished(&w, &c.source, &ctx).await;
        match oracle_resolve(&w, &c.sink, &ckpts).await {
            Ok(n) => local_answers += n as u64,
            Err(e) => w.fail(format!("{ctx}: {e}")),
        }
        // The sink runs: a directory seen between its move into place and
        // its markers' is a publish in flight, so look again a few times.
        let mut last = Ok(0);
        for _ in 0..10 {
            last = oracle_tree(&w, &ckpts);
            if last.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        match last {
            Ok(n) => replicas_checked += n as u64,
            Err(e) => w.fail(format!("{ctx}: {e}")),
        }
        tree_checks += 1;
        baseline = sink_progress(&w, &c.sink, &ckpts)
            .await
            .unwrap_or_else(|e| w.fail(e));
    }

    // Every pushed transfer ends published, byte-identical.
    let pushed: Vec<&Ckpt> = ckpts.iter().filter(|c| c.id.is_some()).collect();
    let source = &c.source;
    let ts = w
        .wait_until("every transfer to be published", TRANSFER, async || {
            let ts = w.transfers(source).await;
            for t in &ts {
                if matches!(s(t, "state"), "failed" | "cancelled") {
                    w.fail(format!(
                        "seed {seed}: a transfer ended after the kills: {t}"
                    ));
                }
            }
            let published = ts.iter().filter(|t| s(t, "state") == "published").count();
            if published == pushed.len() && ts.len() == pushed.len() {
                Ok(ts)
            } else {
                Err(format!("{published} of {} published", pushed.len()))
            }
        })
        .await;
    let (mut bytes_total, mut bytes_replica, mut bytes_sent) = (0u64, 0u64, 0u64);
    for ck in &pushed {
        let replica = w.replica_path(&ck.rel);
        w.assert_same_tree(&ck.path, &replica);
        let r = w.resolve(&c.sink, &ck.path).await;
        w.ensure(s(&r, "state") == "local", || {
            format!("resolve {}: {r}", ck.rel)
        });
        bytes_total += ck.bytes;
        bytes_replica += tree_bytes(&replica);
    }
    for t in &ts {
        bytes_sent += t["bytes_sent"].as_u64().unwrap_or(0);
    }
    let lost = bytes_total.saturating_sub(bytes_replica);
    w.ensure(lost == 0 && bytes_replica == bytes_total, || {
        format!("{bytes_replica} bytes in replicas, {bytes_total} at the source")
    });
    match oracle_tree(&w, &ckpts) {
        Ok(n) => w.ensure(n == pushed.len(), || {
            format!("{n} replicas published, {} pushed", pushed.len())
        }),
        Err(e) => w.fail(format!("seed {seed}, at the end: {e}")),
    }
    println!(
        "sigkill loop: seed {seed}: {} kills ({sink_kills} sink, {source_kills} source; \
         {mid_transfer} with a transfer unpublished), all survived; {} checkpoints, \
         {bytes_total} bytes, 0 lost, {bytes_sent} bytes sent; {tree_checks} oracle passes \
         over the sink root ({replicas_checked} replica checks), {local_answers} `local` \
         answers checked, 0 partial replicas; {:.1} s",
        sink_kills + source_kills,
        pushed.len(),
        started.elapsed().as_secs_f64()
    );
}

/// Runs `ferry serve --config CONFIG` expecting it to refuse at start:
/// fails the test unless it exits non-zero within 30 s.
async fn serve_refused(w: &World, config: &Path, why: &str) -> CmdOutput {
    let out = w
        .ferry(
            &["serve", "--config", config.to_str().unwrap()],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(!out.success(), || {
        format!("ferry serve should refuse to start ({why}): {out}")
    });
    out
}

/// A second agent on the data directory of a running one refuses at start
/// naming the directory and its lock, and the running one keeps working;
/// so does an agent whose lock another process holds.
#[tokio::test]
async fn a_locked_catalog_refuses_to_start_and_the_running_agent_keeps_working() {
    let w = World::new("catalog-lock").await;
    let ckpt = w.source_root().join("step_000100");
    w.gen(&ckpt, "4MB").await;
    let mut c = w.start_cluster("200Mbit/s", &[], |_, _| {}).await;
    let data_dir = c.sink.cfg.data_dir.clone();

    // A second sink with its own ports and root but the same data_dir.
    let mut cfg2 = c.sink.cfg.clone();
    cfg2.api_port = free_tcp_port();
    cfg2.quic_listen = format!("127.0.0.1:{}", free_udp_port());
    let root2 = w.root.join("sink2-root");
    fs::create_dir_all(&root2).unwrap();
    cfg2.sink.as_mut().unwrap().root = root2.clone();
    let config2 = w.root.join("sink2.toml");
    fs::write(&config2, cfg2.to_toml()).unwrap();
    let out = serve_refused(&w, &config2, "its data_dir is in use").await;
    let all = out.all();
    w.ensure(
        all.contains(data_dir.to_str().unwrap()) && all.contains("agent.lock"),
        || {
            format!(
                "the refusal should name {} and agent.lock: {out}",
                data_dir.display()
            )
        },
    );
    w.ensure(fs::read_dir(&root2).unwrap().next().is_none(), || {
        format!(
            "the refused agent wrote into its sink root {}",
            root2.display()
        )
    });

    // The running sink is untouched: a push still replicates.
    let out = w.push(&c.source, &ckpt, &[]).await;
    w.ensure(out.success(), || {
        format!("ferry push after the refusal: {out}")
    });
    let replica = w.replica_path("step_000100");
    w.assert_same_tree(&ckpt, &replica);

    // The lock held by another process while no agent runs.
    let stopped = c.sink.terminate(Duration::from_secs(10));
    w.ensure(stopped.is_some_and(|(st, _)| st.success()), || {
        format!("the sink did not stop cleanly: {stopped:?}")
    });
    let lock_path = data_dir.join("agent.lock");
    let held = nix::fcntl::Flock::lock(
        File::open(&lock_path).unwrap(),
        nix::fcntl::FlockArg::LockExclusiveNonblock,
    )
    .unwrap_or_else(|(_, e)| w.fail(format!("cannot lock {}: {e}", lock_path.display())));
    let out = serve_refused(&w, &c.sink.config_path, "agent.lock is held").await;
    w.ensure(
        out.all().contains(data_dir.to_str().unwrap()) && out.all().contains("agent.lock"),
        || {
            format!(
                "the refusal should name {} and agent.lock: {out}",
                data_dir.display()
            )
        },
    );
    drop(held);

    // Released: the sink starts with its replica.
    w.restart(&mut c.sink).await;
    let r = w.resolve(&c.sink, &ckpt).await;
    w.ensure(s(&r, "state") == "local", || {
        format!("resolve after the lock: {r}")
    });
    w.assert_same_tree(&ckpt, &replica);
}

/// A sink whose catalog file is damaged (its header, or pages inside)
/// refuses at start with an error naming the file, and deletes nothing:
/// the catalog and the published replica stay; the intact catalog back in
/// place, the sink starts and resolves the replica as before.
#[tokio::test]
async fn a_corrupted_catalog_refuses_to_start_and_deletes_nothing() {
    let w = World::new("catalog-corrupt").await;
    let ckpt = w.source_root().join("step_000200");
    w.gen(&ckpt, "4MB").await;
    let mut c = w.start_cluster("200Mbit/s", &[], |_, _| {}).await;
    let out = w.push(&c.source, &ckpt, &[]).await;
    w.ensure(out.success(), || format!("ferry push: {out}"));
    let replica = w.replica_path("step_000200");
    w.assert_same_tree(&ckpt, &replica);
    let stopped = c.sink.terminate(Duration::from_secs(10));
    w.ensure(stopped.is_some_and(|(st, _)| st.success()), || {
        format!("the sink did not stop cleanly: {stopped:?}")
    });

    let db = c.sink.cfg.data_dir.join("ferry.db");
    let pristine = fs::read(&db).unwrap();
    let pages = pristine.len() / 4096;
    w.ensure(pages >= 4, || {
        format!("{} has only {pages} pages", db.display())
    });
    type Damage = fn(&mut Vec<u8>);
    let damages: [(&str, Damage); 2] = [
        ("the header overwritten", |b| b[..100].fill(0xa5)),
        (
            "every page after the first overwritten from byte 0 to 63",
            |b| {
                for p in 1..b.len() / 4096 {
                    b[p * 4096..p * 4096 + 64].fill(0x5a);
                }
            },
        ),
    ];
    for (what, damage) in damages {
        let mut bad = pristine.clone();
        damage(&mut bad);
        fs::write(&db, &bad).unwrap();
        let out = serve_refused(&w, &c.sink.config_path, what).await;
        w.ensure(out.all().contains(db.to_str().unwrap()), || {
            format!(
                "with {what}, the refusal should name {}: {out}",
                db.display()
            )
        });
        w.ensure(fs::read(&db).ok().as_deref() == Some(&bad[..]), || {
            format!("with {what}, {} was changed or removed", db.display())
        });
        w.assert_same_tree(&ckpt, &replica);
    }

    fs::write(&db, &pristine).unwrap();
    w.restart(&mut c.sink).await;
    let r = w.resolve(&c.sink, &ckpt).await;
    w.ensure(s(&r, "state") == "local", || {
        format!("resolve with the catalog restored: {r}")
    });
    w.assert_same_tree(&ckpt, &replica);
}

/// A tmpfs mounted for one test, lazily unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mounts a tmpfs of `size` at `dir`; `Err` with why if not permitted.
    fn mount(dir: &Path, size: &str) -> Result<Tmpfs, String> {
        fs::create_dir_all(dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if out.status.success() {
            Ok(Tmpfs(dir.to_path_buf()))
        } else {
            Err(String::from_utf8_lossy(&out.stderr).trim().to_string())
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Fills the file system holding `dir` with a file `dir/filler` until
/// writes fail for lack of space; returns the bytes written.
fn fill(dir: &Path) -> u64 {
    use std::io::Write;
    let mut f = File::create(dir.join("filler")).unwrap();
    let block = vec![0x77u8; 64 << 10];
    let mut n = 0u64;
    loop {
        match f.write(&block) {
            Ok(0) => return n,
            Ok(k) => n += k as u64,
            Err(e) if e.raw_os_error() == Some(nix::libc::ENOSPC) => return n,
            Err(e) => panic!("filling {}: {e}", dir.display()),
        }
    }
}

/// Everything under `dir` (relative paths), for failure messages.
fn listing(dir: &Path) -> Vec<String> {
    if dir.exists() {
        walk(dir).into_keys().collect()
    } else {
        Vec::new()
    }
}

/// A sink root on a 20 MB tmpfs: a checkpoint bigger than the space is
/// refused up front; one that fits when admitted but runs out of space
/// while it is written (the file system filled behind its back) fails
/// with a clear error, nothing is published, its staging space is
/// released, the API keeps answering and the next transfer works.
#[tokio::test]
async fn sink_disk_full_fails_cleanly_and_releases_space() {
    let w = World::new("diskfull").await;
    let small = w.root.join("small");
    let _tmpfs = match Tmpfs::mount(&small, "20m") {
        Ok(m) => m,
        Err(why) => {
            println!("SKIPPED sink_disk_full_fails_cleanly_and_releases_space: cannot mount a tmpfs ({why})");
            return;
        }
    };
    let sink_root = small.join("root");
    fs::create_dir_all(&sink_root).unwrap();
    let replica = |rel: &str| sink_root.join(SOURCE_SITE).join(JOB).join(rel);
    let published = || -> Vec<String> {
        fs::read_dir(&sink_root)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n != ".ferry")
            .collect()
    };
    let (big, fits, next) = (
        w.source_root().join("step_000100"),
        w.source_root().join("step_000200"),
        w.source_root().join("step_000300"),
    );
    w.gen(&big, "30MB").await;
    w.gen(&fits, "12MB").await;
    w.gen(&next, "2MB").await;
    let root2 = sink_root.clone();
    let c = w
        .start_cluster("24Mbit/s", &[], move |sink, _| {
            let s = sink.sink.as_mut().unwrap();
            s.root = root2;
            s.reserve = Some("1MB".into());
        })
        .await;

    // Bigger than the file system: refused before a byte is written.
    let out = w.push(&c.source, &big, &[]).await;
    w.ensure(
        !out.success() && out.all().contains("not enough space"),
        || format!("pushing 30 MB into 20 MB should fail for lack of space: {out}"),
    );

    // Admitted, then the space goes while it is written.
    let id = w.push_no_wait(&c.source, &fits).await;
    let sink = &c.sink;
    w.wait_until("the sink to receive chunks", TRANSFER, async || {
        let r = w.try_resolve(sink, &fits).await?;
        if r["bytes_done"].as_u64().unwrap_or(0) > 0 {
            Ok(())
        } else {
            Err(r.to_string())
        }
    })
    .await;
    let filled = fill(&small);
    let source = &c.source;
    let t = w
        .wait_until("the transfer to fail", TRANSFER, async || {
            let t = w.transfer(source, id).await;
            match s(&t, "state") {
                "failed" => Ok(t),
                "published" => w.fail(format!(
                    "the transfer was published although the disk filled ({filled} bytes): {t}"
                )),
                _ => Err(t.to_string()),
            }
        })
        .await;
    let error = s(&t, "error");
    w.ensure(error.contains("No space left on device"), || {
        format!("the transfer's error should say the sink's disk is full: {t}")
    });
    w.ensure(published().is_empty(), || {
        format!("nothing should be published: {:?}", listing(&sink_root))
    });
    let r = w.resolve(&c.sink, &fits).await;
    w.ensure(s(&r, "state") != "local", || format!("resolve: {r}"));
    let staging = sink_root.join(".ferry").join("staging");
    w.wait_until("the staging space to be released", TRANSFER, async || {
        let left = files_under(&staging);
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    })
    .await;
    let h = w
        .http()
        .get(format!("{}/healthz", c.sink.url()))
        .send()
        .await;
    w.ensure(h.as_ref().is_ok_and(|r| r.status().is_success()), || {
        format!("the sink's /healthz after the disk filled: {h:?}")
    });

    // The space back, the next transfer works.
    fs::remove_file(small.join("filler")).unwrap();
    let out = w.push(&c.source, &next, &[]).await;
    w.ensure(out.success(), || {
        format!("ferry push after the disk was full: {out}")
    });
    w.assert_same_tree(&next, &replica("step_000300"));
    w.ensure(!replica("step_000200").exists(), || {
        "the failed checkpoint appeared".to_string()
    });
    println!(
        "disk full: 1 refusal up front, 1 ENOSPC while writing ({filled} bytes filled), \
         0 published partially, staging released, next transfer published"
    );
}

/// Bytes of the sink's staging area changed on disk after they were
/// verified (here while the sink is stopped) are found when the replica is
/// about to be published: read back, counted as verification failures,
/// fetched again, and the replica published byte-identical.
#[tokio::test]
async fn bytes_changed_in_staging_are_found_before_publish_and_fetched_again() {
    let w = World::new("staging-corrupt").await;
    let ckpt = w.source_root().join("step_000300");
    w.gen(&ckpt, "12MB").await;
    // 8 Mbit/s: 12 s for the checkpoint. Chunks complete out of order
    // across the data streams, so wait for the first verified one rather
    // than a byte count the sink may pass only near the end.
    let mut c = w.start_cluster("8Mbit/s", &[], |_, _| {}).await;
    let id = w.push_no_wait(&c.source, &ckpt).await;
    let sink = &c.sink;
    let done = w
        .wait_until("a chunk verified at the sink", TRANSFER, async || {
            let r = w.try_resolve(sink, &ckpt).await?;
            let done = r["bytes_done"].as_u64().unwrap_or(0);
            if s(&r, "state") == "replicating" && done > 0 {
                Ok(done)
            } else {
                Err(format!("{r}"))
            }
        })
        .await;
    // A clean stop records every verified chunk in the catalog (it drains
    // for at most 10 s; a loaded machine may take longer to exit).
    let stopped = c.sink.terminate(Duration::from_secs(60));
    w.ensure(stopped.is_some_and(|(st, _)| st.success()), || {
        format!("the sink did not stop cleanly: {stopped:?}")
    });
    // Flip a byte every 64 KiB of every staged file where the data has
    // arrived (it equals the source), so every staged chunk changes.
    let staging = w.sink_root().join(".ferry/staging");
    let (mut flipped, mut files) = (0u64, 0u64);
    for (rel, staged) in walk(&staging) {
        if !staged.is_file() {
            continue;
        }
        // <staging>/<transfer dir>/<path in the checkpoint>
        let Some((_, inner)) = rel.split_once('/') else {
            continue;
        };
        let original = fs::read(ckpt.join(inner)).unwrap();
        let bytes = fs::read(&staged).unwrap();
        let mut any = false;
        for off in (0..bytes.len().min(original.len())).step_by(64 * 1024) {
            if bytes[off] == original[off] && original[off..].iter().take(64).any(|&b| b != 0) {
                flip_byte(&staged, off as u64);
                flipped += 1;
                any = true;
            }
        }
        files += u64::from(any);
    }
    w.ensure(flipped > 0, || {
        format!(
            "no staged data to damage under {} ({done} bytes verified)",
            staging.display()
        )
    });
    w.restart(&mut c.sink).await;
    wait_published(&w, &c.source, id, "the transfer").await;
    w.assert_same_tree(&ckpt, &w.replica_path("step_000300"));
    let m = scrape(&w, &c.sink).await;
    let failures = metric(&m, "ferry_verification_failures_total", &[]).unwrap_or(0.0);
    w.ensure(failures >= 1.0, || {
        format!("the restarted sink counted {failures} verification failures")
    });
    w.ensure(
        c.sink
            .stderr()
            .contains("staged chunks no longer match the manifest"),
        || "the sink did not log the changed staged chunks".to_string(),
    );
    println!(
        "staging corruption: {flipped} bytes flipped in {files} staged files after {done} bytes \
         were verified; {failures} chunks failed the check before publish and were fetched \
         again; replica byte-identical"
    );
}

/// The sink SIGKILLs itself at each point of a publish where a crash
/// leaves work on disk (markers set aside, staging moved into its version
/// directory, markers moved in, the published link switched, all done but
/// the catalog not told). While it is dead
/// a directory at the published path never has its commit marker unless it
/// is complete; after a restart the publish is finished, the replica is
/// byte-identical, `local` for resolve, and nothing is left in staging.
#[tokio::test]
async fn a_publish_cut_short_by_a_kill_is_finished_after_restart() {
    let w = World::new("publish-kill").await;
    let mut c = w.start_cluster("200Mbit/s", &[], |_, _| {}).await;
    let points = [
        "markers-held",
        "placed",
        "markers-in",
        "switched",
        "on-disk",
    ];
    let mut finished = 0;
    for (i, point) in points.iter().enumerate() {
        let rel = format!("step_{:06}", (i + 1) * 100);
        let ckpt = w.source_root().join(&rel);
        w.gen(&ckpt, "3MB").await;
        c.sink.set_env(FAULT_ENV, Some(point));
        w.restart(&mut c.sink).await;
        let id = w.push_no_wait(&c.source, &ckpt).await;
        let sink = &mut c.sink;
        let status = w
            .wait_until(
                &format!("the sink to kill itself at {point}"),
                TRANSFER,
                async || sink.exited().ok_or_else(|| "still running".to_string()),
            )
            .await;
        w.ensure(
            std::os::unix::process::ExitStatusExt::signal(&status) == Some(9),
            || format!("{point}: the sink exited with {status}, not SIGKILL"),
        );
        // While it is dead: complete, or every data file complete and no
        // commit marker.
        let replica = w.replica_path(&rel);
        if replica.join("COMMITTED").exists() {
            tree_diff(&ckpt, &replica)
                .unwrap_or_else(|e| w.fail(format!("{point}: a committed partial replica: {e}")));
        } else if replica.exists() {
            for (f, orig) in walk(&ckpt) {
                if f != "COMMITTED" && orig.is_file() {
                    let got = fs::read(replica.join(&f)).unwrap_or_default();
                    w.ensure(got == fs::read(&orig).unwrap(), || {
                        format!("{point}: {f} in place before it is complete")
                    });
                }
            }
        }
        c.sink.set_env(FAULT_ENV, None);
        w.restart(&mut c.sink).await;
        wait_published(&w, &c.source, id, &format!("{point}: the transfer")).await;
        w.assert_same_tree(&ckpt, &replica);
        let r = w.resolve(&c.sink, &ckpt).await;
        w.ensure(s(&r, "state") == "local", || {
            format!("{point}: resolve {r}")
        });
        let left = files_under(&w.sink_root().join(".ferry/staging"));
        w.ensure(left.is_empty(), || {
            format!("{point}: left in staging: {left:?}")
        });
        w.ensure(
            c.sink
                .stderr()
                .matches("finished a publish that a crash had interrupted")
                .count()
                == i + 1,
            || format!("{point}: the sink did not say it finished the interrupted publish"),
        );
        finished += 1;
    }
    // The restarted sink keeps its stateless-reset and connection-ID keys,
    // so the source learns at once that its old connection is gone.
    w.ensure(c.source.stderr().contains("reset by peer"), || {
        "the source never saw a stateless reset from the restarted sink".to_string()
    });
    println!("publish window: {finished} kills inside a publish, {finished} replicas finished after restart");
}

/// Waits until the source's transfer `id` is published; fails the test if
/// it fails or is cancelled. `what` names it in messages.
async fn wait_published(w: &World, source: &Agent, id: i64, what: &str) {
    w.wait_until(&format!("{what} to be published"), TRANSFER, async || {
        let t = w.transfer(source, id).await;
        match s(&t, "state") {
            "published" => Ok(()),
            "failed" | "cancelled" => w.fail(format!("{what} ended: {t}")),
            _ => Err(format!("{t}")),
        }
    })
    .await;
}

/// [`replicator::sink::FAULT_KILL_ENV`].
const FAULT_ENV: &str = "FERRY_FAULT_KILL_IN_PUBLISH";

/// A checkpoint saved again at the same path replaces its replica by an
/// exchange. A sink killed inside that publish, restarted while the source
/// cannot reach it, must not resolve the path to the old version (its
/// directory may already hold the new one, without its marker); once the
/// link is back the publish is finished and resolve names the new root.
#[tokio::test]
async fn a_resave_cut_short_in_its_publish_never_resolves_to_the_old_version() {
    let w = World::new("resave-kill").await;
    let mut c = w.start_cluster("200Mbit/s", &[], |_, _| {}).await;
    let rel = "step_000100";
    let ckpt = w.source_root().join(rel);
    w.gen(&ckpt, "3MB").await;
    let out = w.push(&c.source, &ckpt, &[]).await;
    w.ensure(out.success(), || format!("ferry push: {out}"));
    let replica = w.replica_path(rel);
    let first = w.resolve(&c.sink, &ckpt).await;
    let mut roots = vec![s(&first, "manifest_root").to_string()];
    let victim = files_under(&ckpt)
        .into_iter()
        .find(|f| f != "COMMITTED")
        .unwrap();
    for (round, point) in ["placed", "markers-in", "switched", "on-disk"]
        .iter()
        .enumerate()
    {
        // The job saves the step again: other bytes, a newer mtime.
        flip_byte(&ckpt.join(&victim), round as u64);
        c.sink.set_env(FAULT_ENV, Some(point));
        w.restart(&mut c.sink).await;
        let id = w.push_no_wait(&c.source, &ckpt).await;
        let sink = &mut c.sink;
        w.wait_until(
            &format!("the sink to kill itself at {point}"),
            TRANSFER,
            async || sink.exited().ok_or_else(|| "still running".to_string()),
        )
        .await;
        // The source cannot reach the sink when it comes back.
        c.relay().signal(nix::sys::signal::Signal::SIGUSR1);
        let relay = c.relay();
        w.wait_until("the relay to cut the link", TRANSFER, async || {
            if relay.stdout().contains("link cut") {
                Ok(())
            } else {
                Err(relay.stdout())
            }
        })
        .await;
        c.sink.set_env(FAULT_ENV, None);
        w.restart(&mut c.sink).await;
        let r = w.resolve(&c.sink, &ckpt).await;
        w.ensure(s(&r, "state") == "replicating", || {
            format!("{point}: resolve while the publish is unfinished: {r}")
        });
        c.relay().signal(nix::sys::signal::Signal::SIGUSR2);
        wait_published(&w, &c.source, id, &format!("{point}: the re-save")).await;
        w.assert_same_tree(&ckpt, &replica);
        let r = w.resolve(&c.sink, &ckpt).await;
        let root = s(&r, "manifest_root").to_string();
        w.ensure(s(&r, "state") == "local" && !roots.contains(&root), || {
            format!("{point}: resolve after the publish: {r}, earlier roots {roots:?}")
        });
        roots.push(root);
    }
    println!(
        "re-save publish window: {} kills, never resolved to an old version",
        roots.len() - 1
    );
}
