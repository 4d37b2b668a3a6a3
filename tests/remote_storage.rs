//! End-to-end: `ferry serve` sink agents whose `[sink] root` is an HDFS
//! directory (a MiniDFSCluster) or an S3 prefix (SeaweedFS), configured
//! as a user would (a URL, `[sink.s3]` with a key file), fed by a source
//! agent through the relay. A generated checkpoint is published there
//! byte-identical, and `ferry resolve` prints its URL.
//!
//! The servers are started by `ops/test` (through
//! `ops/with-test-servers`), which passes their addresses in
//! FERRY_TEST_HDFS_URL, FERRY_TEST_S3_URL and the S3 key pair in
//! FERRY_TEST_S3_ACCESS_KEY_ID / FERRY_TEST_S3_SECRET_ACCESS_KEY.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::remote::*;
use common::*;
use ferry_proto::manifest::Manifest;
use replicator::storage::hdfs::Hdfs;
use replicator::storage::posix::Posix;
use replicator::storage::s3::{S3Config, S3};
use replicator::storage::{build, SourceStore};

/// Generates a checkpoint, replicates it to a sink agent on `r` (its
/// root URL and `[sink]` lines), checks it through `r.store`, and has
/// `ferry verify` of its URL pass, then fail on a file changed in the
/// store.
async fn replicates_to(w: &World, r: &RemoteSink) {
    let (url, sink_lines, store, root) = (&r.url, &r.lines, &*r.store, &r.root);
    let ckpt = w.source_root().join("step_000100");
    w.gen(&ckpt, "6MB").await;
    let c = w
        .start_cluster("500Mbit/s", &[], |sink, _| {
            let spec = sink.sink.as_mut().unwrap();
            spec.root = PathBuf::from(url);
            spec.extra = sink_lines.to_string();
        })
        .await;
    let out = w.push(&c.source, &ckpt, &[]).await;
    w.ensure(out.success(), || format!("ferry push failed: {out}"));

    let replica = format!("{root}/{SOURCE_SITE}/{JOB}/step_000100");
    let want_url = format!("{url}/{SOURCE_SITE}/{JOB}/step_000100");
    let markers = ["COMMITTED".to_string()];
    let chunk = ferry_proto::manifest::MIN_CHUNK_SIZE;
    let original = build(&Posix, &ckpt, &markers, chunk).unwrap();
    let copy = build(store, Path::new(&replica), &markers, chunk)
        .unwrap_or_else(|e| w.fail(format!("reading the replica at {want_url}: {e}")));
    w.ensure(content(&copy) == content(&original), || {
        format!(
            "the replica at {want_url} differs from {}: {} files vs {}",
            ckpt.display(),
            copy.files.len(),
            original.files.len()
        )
    });

    // `ferry resolve` prints the URL; the API answers it without a local
    // path, and the replica row names it too.
    let out = w
        .ferry(
            &["resolve", ckpt.to_str().unwrap(), "--server", &c.sink.url()],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(out.success() && out.stdout.trim() == want_url, || {
        format!("ferry resolve should print {want_url}: {out}")
    });
    let res = w.resolve(&c.sink, &ckpt).await;
    w.ensure(
        s(&res, "state") == "local" && res.get("local_path").is_none(),
        || format!("resolve on a remote sink: {res}"),
    );
    let reps = w.get_json(&format!("{}/v1/replicas", c.sink.url())).await;
    let row = &reps["items"][0];
    w.ensure(s(row, "url") == want_url, || {
        format!("the replica row should name {want_url}: {reps}")
    });
    // The source records where the replica went.
    let ts = w.transfers(&c.source).await;
    w.ensure(ts.len() == 1 && s(&ts[0], "local_path") == want_url, || {
        format!("the source's transfer should name {want_url}: {ts:?}")
    });

    // `ferry verify` reads the replica through the store by its URL.
    let out = w.verify(&c.sink, Path::new(&want_url)).await;
    w.ensure(
        out.success() && out.stdout.contains("OK: every chunk matches"),
        || format!("ferry verify {want_url}: {out}"),
    );
    // A file changed in the store (same size, one byte flipped) is named.
    let victim = original
        .files
        .iter()
        .find(|f| f.size > 0 && !markers.contains(&f.path))
        .unwrap();
    let mut bytes = std::fs::read(ckpt.join(&victim.path)).unwrap();
    bytes[0] ^= 0xff;
    (r.put)(
        &(r.object_of)(&Path::new(&replica).join(&victim.path)),
        &bytes,
    )
    .unwrap();
    let out = w.verify(&c.sink, Path::new(&want_url)).await;
    let want = format!("MISMATCH {}: chunk 0 hashes to", victim.path);
    w.ensure(!out.success() && out.stdout.contains(&want), || {
        format!(
            "ferry verify after {} changed should say {want}: {out}",
            victim.path
        )
    });
    // A URL outside the sink's root is refused, naming the root.
    let outside = format!("{url}-elsewhere/step_000100");
    let out = w.verify(&c.sink, Path::new(&outside)).await;
    w.ensure(
        !out.success() && out.stderr.contains("outside storage root"),
        || format!("ferry verify {outside}: {out}"),
    );
}

#[tokio::test]
async fn a_sink_agent_on_s3_publishes_and_resolves_to_a_url() {
    let w = World::new("s3-sink").await;
    let r = s3_sink(&w, "s3-sink");
    replicates_to(&w, &r).await;
}

#[tokio::test]
async fn a_sink_agent_on_hdfs_publishes_and_resolves_to_a_url() {
    let w = World::new("hdfs-sink").await;
    let r = hdfs_sink("hdfs-sink");
    replicates_to(&w, &r).await;
}

/// Under `keep_last = 1`, a re-save's publish removes the older replica
/// from the remote sink: its row says `removed`, nothing of it is left in
/// the store (S3: no commit object and no object under its prefix), and
/// the newer replica stays whole and committed. Then the newer one is
/// removed by hand (`ferry replica rm`).
async fn removes_from(w: &World, r: &RemoteSink) {
    let lines = format!(
        "retention_interval = \"1s\"\n{}\n[[sink.retention]]\njob = \"*\"\nkeep_last = 1\n",
        r.lines
    );
    let c = w
        .start_cluster("500Mbit/s", &[], |sink, _| {
            let spec = sink.sink.as_mut().unwrap();
            spec.root = PathBuf::from(&r.url);
            spec.extra = lines.clone();
        })
        .await;
    let markers = ["COMMITTED".to_string()];
    let chunk = ferry_proto::manifest::MIN_CHUNK_SIZE;
    let replica = |step: &str| PathBuf::from(format!("{}/{SOURCE_SITE}/{JOB}/{step}", r.root));
    for step in ["step_000100", "step_000200"] {
        let ckpt = w.source_root().join(step);
        w.gen(&ckpt, "3MB").await;
        let out = w.push(&c.source, &ckpt, &[]).await;
        w.ensure(out.success(), || format!("ferry push {step}: {out}"));
    }
    let rows_url = format!("{}/v1/replicas", c.sink.url());
    let row_of = |reps: &serde_json::Value, step: &str| {
        reps["items"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|x| s(x, "local_path").ends_with(step) || s(x, "url").ends_with(step))
            .cloned()
    };
    let old = w
        .wait_until("the older replica to be removed", TRANSFER, async || {
            let reps = w.get_json(&format!("{rows_url}?state=removed")).await;
            row_of(&reps, "step_000100").ok_or_else(|| format!("{reps}"))
        })
        .await;
    w.ensure(s(&old["removal"], "reason") == "rule", || {
        format!("removed by the policy: {old}")
    });
    w.ensure(!(r.committed)(&replica("step_000100")), || {
        "the removed replica is still committed".to_string()
    });
    w.ensure(r.store.list(&replica("step_000100"), &[]).is_err(), || {
        "files of the removed replica are left in the store".to_string()
    });
    let original = build(
        &Posix,
        &w.source_root().join("step_000200"),
        &markers,
        chunk,
    )
    .unwrap();
    let copy = build(&*r.store, &replica("step_000200"), &markers, chunk).unwrap();
    w.ensure(
        (r.committed)(&replica("step_000200")) && content(&copy) == content(&original),
        || "the newer replica should stay whole and committed".to_string(),
    );

    let reps = w.get_json(&format!("{rows_url}?state=published")).await;
    let id = row_of(&reps, "step_000200")
        .unwrap_or_else(|| w.fail(format!("no published row for step 200: {reps}")))["id"]
        .as_i64()
        .unwrap()
        .to_string();
    let out = w
        .ferry(
            &["replica", "rm", &id, "--server", &c.sink.url()],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(out.success(), || format!("ferry replica rm {id}: {out}"));
    w.wait_until("the newer replica to be removed", TRANSFER, async || {
        let reps = w.get_json(&format!("{rows_url}?state=removed")).await;
        row_of(&reps, "step_000200").ok_or_else(|| format!("{reps}"))
    })
    .await;
    w.ensure(
        !(r.committed)(&replica("step_000200"))
            && r.store.list(&replica("step_000200"), &[]).is_err(),
        || "the replica removed by hand is still in the store".to_string(),
    );
}

#[tokio::test]
async fn an_s3_sink_removes_replicas_by_policy_and_by_hand() {
    let w = World::new("s3-remove").await;
    let r = s3_sink(&w, "s3-remove");
    removes_from(&w, &r).await;
}

#[tokio::test]
async fn an_hdfs_sink_removes_replicas_by_policy_and_by_hand() {
    let w = World::new("hdfs-remove").await;
    let r = hdfs_sink("hdfs-remove");
    removes_from(&w, &r).await;
}

/// Reader leases on a remote sink that keeps versions: `ferry resolve
/// --lease` prints the URL of the version's own prefix or directory; a
/// re-save publishes a new version (on S3 keeping the unchanged objects
/// by reference: their URLs are the older version's), while the leased
/// version stays whole. Released, the older version goes at the next
/// sweep (S3: but the objects the newer one names); removed by hand, the
/// newer one leaves nothing under the versions.
async fn keeps_a_leased_version(w: &World, r: &RemoteSink) {
    let lines = format!("retention_interval = \"1s\"\n{}", r.lines);
    let c = w
        .start_cluster("500Mbit/s", &[], |sink, _| {
            let spec = sink.sink.as_mut().unwrap();
            spec.root = PathBuf::from(&r.url);
            spec.extra = lines.clone();
        })
        .await;
    let markers = ["COMMITTED".to_string()];
    let chunk = ferry_proto::manifest::MIN_CHUNK_SIZE;
    let ckpt = w.source_root().join("step_000100");
    w.gen(&ckpt, "3MB").await;
    let out = w.push(&c.source, &ckpt, &[]).await;
    w.ensure(out.success(), || format!("ferry push: {out}"));
    let v1 = build(&Posix, &ckpt, &markers, chunk).unwrap();
    let replica = PathBuf::from(format!("{}/{SOURCE_SITE}/{JOB}/step_000100", r.root));
    let path_of = |url: &str| PathBuf::from(format!("/{}", url.splitn(4, '/').nth(3).unwrap()));

    let out = w
        .ferry(
            &[
                "resolve",
                ckpt.to_str().unwrap(),
                "--lease",
                "10m",
                "--server",
                &c.sink.url(),
            ],
            &[],
            Duration::from_secs(30),
        )
        .await;
    let leased = out.stdout.trim().to_string();
    w.ensure(
        out.success() && leased.starts_with(&format!("{}/.ferry/versions/", r.url)),
        || format!("ferry resolve --lease should print the version's URL: {out}"),
    );
    let lease_id = out
        .stderr
        .split_whitespace()
        .skip_while(|x| *x != "lease")
        .nth(1)
        .unwrap_or_else(|| w.fail(format!("no lease id: {out}")))
        .to_string();
    let leased_at = path_of(&leased);

    // A re-save: one file changed, the others kept by reference.
    let victim = v1
        .files
        .iter()
        .find(|f| f.size > 0 && !markers.contains(&f.path))
        .unwrap()
        .path
        .clone();
    let mut bytes = std::fs::read(ckpt.join(&victim)).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(ckpt.join(&victim), &bytes).unwrap();
    let out = w.push(&c.source, &ckpt, &[]).await;
    w.ensure(out.success(), || {
        format!("ferry push of the re-save: {out}")
    });
    let v2 = build(&Posix, &ckpt, &markers, chunk).unwrap();
    let now = build(&*r.store, &replica, &markers, chunk).unwrap();
    w.ensure(content(&now) == content(&v2), || {
        "the published path should name the re-save".to_string()
    });
    let then = build(&*r.store, &leased_at, &markers, chunk).unwrap();
    w.ensure(content(&then) == content(&v1), || {
        format!("the leased version {leased} should stay the first save")
    });
    let kept = v1
        .files
        .iter()
        .find(|f| f.path != victim && f.size > 0)
        .unwrap();
    let kept_at = (r.object_of)(&replica.join(&kept.path));
    // (HDFS copies unchanged files of 64 MiB and more, and sends smaller
    // ones again: the re-save has its own.)
    let by_reference = r.url.starts_with("s3://");
    w.ensure(kept_at.starts_with(&leased_at) == by_reference, || {
        format!(
            "{} is unchanged: the re-save should name the first save's object, not {}",
            kept.path,
            kept_at.display()
        )
    });

    // The publish events name each version where readers find it: the
    // same URL as the replica rows (S3: the published path; HDFS with
    // versions: the version's own directory).
    let rows = w.get_json(&format!("{}/v1/replicas", c.sink.url())).await;
    let events = publish_events(&c.sink.url(), 2).await;
    for e in &events {
        let row = rows["items"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["id"] == e["replica"])
            .unwrap_or_else(|| w.fail(format!("no row for event {e}: {rows}")));
        w.ensure(
            s(e, "location") == s(row, "url") && s(e, "location").contains("://"),
            || format!("event {e} should give its replica's URL {}", s(row, "url")),
        );
    }
    if !by_reference {
        w.ensure(s(&events[0], "location") == leased, || {
            format!(
                "the first publish event should name {leased}: {}",
                events[0]
            )
        });
    }

    // Released: the first save's version goes, its kept objects stay.
    let del = reqwest::Client::new()
        .delete(format!("{}/v1/leases/{lease_id}", c.sink.url()))
        .send()
        .await
        .unwrap();
    w.ensure(del.status().is_success(), || {
        format!("releasing the lease: {del:?}")
    });
    w.wait_until("the released version to be deleted", TRANSFER, async || {
        if (r.committed)(&leased_at) {
            Err(format!("{leased} is still committed"))
        } else {
            Ok(())
        }
    })
    .await;
    // (On S3 the objects the re-save names stay under its prefix.)
    w.ensure(
        by_reference || r.store.list(&leased_at, &[]).is_err(),
        || format!("files of {leased} are left"),
    );
    let now = build(&*r.store, &replica, &markers, chunk).unwrap();
    w.ensure(content(&now) == content(&v2), || {
        "the re-save should stay whole once the first save is deleted".to_string()
    });

    // Removed by hand: nothing of either version is left.
    let reps = w
        .get_json(&format!("{}/v1/replicas?state=published", c.sink.url()))
        .await;
    let id = reps["items"][0]["id"].as_i64().unwrap().to_string();
    let out = w
        .ferry(
            &["replica", "rm", &id, "--server", &c.sink.url()],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(out.success(), || format!("ferry replica rm {id}: {out}"));
    let versions = PathBuf::from(format!("{}/.ferry/versions", r.root));
    w.wait_until("the versions to be deleted", TRANSFER, async || {
        match r.store.list(&versions, &[]) {
            Err(_) => Ok(()),
            Ok(l) if l.files.is_empty() => Ok(()),
            Ok(l) => Err(format!(
                "left: {:?}",
                l.files.iter().map(|f| &f.info.path).collect::<Vec<_>>()
            )),
        }
    })
    .await;
}

#[tokio::test]
async fn an_s3_sink_keeps_a_leased_version_through_a_re_save() {
    let w = World::new("s3-lease").await;
    let r = s3_sink(&w, "s3-lease");
    keeps_a_leased_version(&w, &r).await;
}

#[tokio::test]
async fn an_hdfs_sink_with_versions_keeps_a_leased_version_through_a_re_save() {
    let w = World::new("hdfs-lease").await;
    let r = hdfs_sink_with("hdfs-lease", true);
    keeps_a_leased_version(&w, &r).await;
}

/// The data of the first `n` `published` events of `GET
/// {url}/v1/replicas/events?since=0`, read within 30 s.
async fn publish_events(url: &str, n: usize) -> Vec<serde_json::Value> {
    let mut resp = reqwest::Client::new()
        .get(format!("{url}/v1/replicas/events?since=0"))
        .send()
        .await
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (mut buf, mut out) = (String::new(), Vec::new());
    while out.len() < n {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let Ok(Ok(Some(chunk))) = tokio::time::timeout(left, resp.chunk()).await else {
            panic!("{} of {n} publish events within 30 s: {out:?}", out.len());
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            if block.lines().any(|l| l.trim() == "event: published") {
                let data: String = block
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(str::trim)
                    .collect();
                out.push(serde_json::from_str(&data).unwrap());
            }
        }
    }
    out
}

/// [`replicator::sink::FAULT_KILL_ENV`].
const FAULT_ENV: &str = "FERRY_FAULT_KILL_IN_PUBLISH";

/// Bound for a transfer that should simply complete.
const TRANSFER: Duration = Duration::from_secs(120);

/// Kills the sink agent (SIGKILL, by the fault-injection points) inside
/// each publish step of `points`: while it is dead a replica readers take
/// as committed is complete; after a restart the publish is finished,
/// byte-identical, resolvable to its URL, and staging is empty.
async fn publish_killed_then_finished(w: &World, r: &RemoteSink, points: &[&str]) {
    let mut c = w
        .start_cluster("500Mbit/s", &[], |sink, _| {
            let spec = sink.sink.as_mut().unwrap();
            spec.root = PathBuf::from(&r.url);
            spec.extra = r.lines.clone();
        })
        .await;
    let markers = ["COMMITTED".to_string()];
    let chunk = ferry_proto::manifest::MIN_CHUNK_SIZE;
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
        let original = build(&Posix, &ckpt, &markers, chunk).unwrap();
        let replica = PathBuf::from(format!("{}/{SOURCE_SITE}/{JOB}/{rel}", r.root));
        if (r.committed)(&replica) {
            let copy = build(&*r.store, &replica, &markers, chunk).unwrap();
            w.ensure(content(&copy) == content(&original), || {
                format!("{point}: a committed replica is not complete")
            });
        }
        c.sink.set_env(FAULT_ENV, None);
        w.restart(&mut c.sink).await;
        w.wait_until(
            &format!("{point}: the transfer to be published"),
            TRANSFER,
            async || {
                let t = w.transfer(&c.source, id).await;
                match s(&t, "state") {
                    "published" => Ok(()),
                    "failed" | "cancelled" => w.fail(format!("{point}: the transfer ended: {t}")),
                    _ => Err(format!("{t}")),
                }
            },
        )
        .await;
        w.ensure((r.committed)(&replica), || {
            format!("{point}: not committed after the restart")
        });
        let copy = build(&*r.store, &replica, &markers, chunk).unwrap();
        w.ensure(content(&copy) == content(&original), || {
            format!("{point}: the replica differs after the restart")
        });
        let res = w.resolve(&c.sink, &ckpt).await;
        // (HDFS with versions: the version's own directory.)
        let want = if r.lines.contains("versions = true") {
            format!("{}/.ferry/versions/", r.url)
        } else {
            format!("{}/{SOURCE_SITE}/{JOB}/{rel}", r.url)
        };
        w.ensure(
            s(&res, "state") == "local"
                && (s(&res, "url") == want
                    || want.ends_with('/') && s(&res, "url").starts_with(&want)),
            || format!("{point}: resolve {res}"),
        );
        let staging = PathBuf::from(format!("{}/.ferry/staging", r.root));
        let left = r
            .store
            .list(&staging, &[])
            .map(|l| l.files.len())
            .unwrap_or(0);
        w.ensure(left == 0, || {
            format!("{point}: {left} files left in staging")
        });
    }
}

#[tokio::test]
async fn an_hdfs_publish_cut_short_by_a_kill_is_finished_after_restart() {
    let w = World::new("hdfs-kill").await;
    let r = hdfs_sink("hdfs-kill");
    publish_killed_then_finished(&w, &r, &["placed", "switched", "on-disk"]).await;
}

#[tokio::test]
async fn an_hdfs_publish_with_versions_cut_short_by_a_kill_is_finished_after_restart() {
    let w = World::new("hdfs-kill-v").await;
    let r = hdfs_sink_with("hdfs-kill-v", true);
    publish_killed_then_finished(&w, &r, &["placed", "switched", "on-disk"]).await;
}

#[tokio::test]
async fn an_s3_publish_cut_short_by_a_kill_is_finished_after_restart() {
    let w = World::new("s3-kill").await;
    let r = s3_sink(&w, "s3-kill");
    publish_killed_then_finished(&w, &r, &["placed", "markers-in", "on-disk"]).await;
}

/// The HDFS sink agent is SIGKILLed while chunks arrive (a file may be
/// open for writing in staging); after a restart the transfer resumes and
/// the replica is byte-identical.
#[tokio::test]
async fn an_hdfs_sink_killed_mid_transfer_resumes() {
    let w = World::new("hdfs-resume").await;
    let r = hdfs_sink("hdfs-resume");
    let ckpt = w.source_root().join("step_000300");
    w.gen(&ckpt, "40MB").await;
    let mut c = w
        .start_cluster("40Mbit/s", &[], |sink, _| {
            let spec = sink.sink.as_mut().unwrap();
            spec.root = PathBuf::from(&r.url);
            spec.extra = r.lines.clone();
        })
        .await;
    let id = w.push_no_wait(&c.source, &ckpt).await;
    let sink = &c.sink;
    w.wait_until(
        "the sink to verify 20 % of the checkpoint",
        TRANSFER,
        async || {
            let res = w.try_resolve(sink, &ckpt).await?;
            let (done, total) = (
                res["bytes_done"].as_u64().unwrap_or(0),
                res["bytes_total"].as_u64().unwrap_or(0),
            );
            if s(&res, "state") == "replicating" && total > 0 && done * 5 >= total {
                Ok(())
            } else {
                Err(res.to_string())
            }
        },
    )
    .await;
    c.sink.kill();
    w.restart(&mut c.sink).await;
    w.wait_until(
        "the transfer to be published after the restart",
        TRANSFER,
        async || {
            let t = w.transfer(&c.source, id).await;
            match s(&t, "state") {
                "published" => Ok(()),
                "failed" | "cancelled" => w.fail(format!("the transfer ended: {t}")),
                _ => Err(format!("{t}")),
            }
        },
    )
    .await;
    let markers = ["COMMITTED".to_string()];
    let chunk = ferry_proto::manifest::MIN_CHUNK_SIZE;
    let original = build(&Posix, &ckpt, &markers, chunk).unwrap();
    let replica = PathBuf::from(format!("{}/{SOURCE_SITE}/{JOB}/step_000300", r.root));
    let copy = build(&*r.store, &replica, &markers, chunk).unwrap();
    w.ensure(content(&copy) == content(&original), || {
        "the replica differs from the checkpoint after the kill".to_string()
    });
}

/// A source agent whose root is an S3 prefix (`[[source.roots]] path =
/// "s3://..."` with `[source.s3]`) and a sink agent whose root is an
/// HDFS directory: a checkpoint written into S3 and pushed by its URL
/// (`ferry push s3://...`) lands in HDFS byte-identical, and `ferry
/// resolve` of its source URL prints the replica's HDFS URL.
#[tokio::test]
async fn a_checkpoint_in_s3_is_pushed_by_its_url_to_an_hdfs_sink() {
    let w = World::new("s3-to-hdfs").await;
    let s3_url = server_env("FERRY_TEST_S3_URL");
    let (endpoint, bucket) = s3_url.rsplit_once('/').unwrap();
    let key_id = server_env("FERRY_TEST_S3_ACCESS_KEY_ID");
    let secret = server_env("FERRY_TEST_S3_SECRET_ACCESS_KEY");
    let secret_file = w.root.join("s3.secret");
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
    let src_root = unique("s3-source");
    let src_url = format!("s3://{bucket}{src_root}");
    let s3 = S3::connect(
        &format!("s3://{bucket}"),
        &S3Config {
            endpoint: Some(endpoint.to_string()),
            region: None,
            access_key_id: Some(key_id.clone()),
            secret_access_key: Some(secret),
            capacity: None,
        },
    )
    .unwrap();
    // The checkpoint, written into S3 as a local save would be: the same
    // files, the marker last.
    let local = w.root.join("local-save/step_000200");
    w.gen(&local, "4MB").await;
    let files = files_under(&local);
    let mut order: Vec<&String> = files.iter().filter(|f| *f != "COMMITTED").collect();
    order.extend(files.iter().filter(|f| *f == "COMMITTED"));
    for rel in order {
        s3.put_file(
            Path::new(&format!("{src_root}/step_000200/{rel}")),
            &std::fs::read(local.join(rel)).unwrap(),
        )
        .unwrap();
    }
    let sink = hdfs_sink("s3-to-hdfs");
    let c = w
        .start_cluster("500Mbit/s", &[], |sink_cfg, src_cfg| {
            let spec = sink_cfg.sink.as_mut().unwrap();
            spec.root = PathBuf::from(&sink.url);
            let src = src_cfg.source.as_mut().unwrap();
            src.root = PathBuf::from(&src_url);
            src.extra = format!(
                "[source.s3]\nendpoint = {}\naccess_key_id = {}\nsecret_access_key_file = {}\n",
                toml_str(endpoint),
                toml_str(&key_id),
                toml_str(secret_file.to_str().unwrap()),
            );
        })
        .await;
    let ckpt_url = format!("{src_url}/step_000200");
    let out = w
        .ferry(
            &["push", &ckpt_url, "--server", &c.source.url()],
            &[],
            TRANSFER,
        )
        .await;
    w.ensure(out.success(), || {
        format!("ferry push {ckpt_url} failed: {out}")
    });
    let replica = PathBuf::from(format!("{}/{SOURCE_SITE}/{JOB}/step_000200", sink.root));
    let markers = ["COMMITTED".to_string()];
    let chunk = ferry_proto::manifest::MIN_CHUNK_SIZE;
    let original = build(&Posix, &local, &markers, chunk).unwrap();
    let copy = build(&*sink.store, &replica, &markers, chunk).unwrap();
    w.ensure(content(&copy) == content(&original), || {
        "the HDFS replica differs from the checkpoint written into S3".to_string()
    });
    let want = format!("{}/{SOURCE_SITE}/{JOB}/step_000200", sink.url);
    let out = w
        .ferry(
            &["resolve", &ckpt_url, "--server", &c.sink.url()],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(out.success() && out.stdout.trim() == want, || {
        format!("ferry resolve {ckpt_url} should print {want}: {out}")
    });
}

/// Where a test's sink keeps replicas (or its source reads them: HDFS
/// or S3).
enum SinkKind {
    Posix,
    Hdfs,
    S3,
}

/// An S3 or HDFS source root for a test: its URL, its path in the store,
/// a store to read it with, the `[source]` lines it needs, and the flags
/// `ferry gen --out URL` needs.
struct RemoteSource {
    url: String,
    root: String,
    store: Box<dyn SourceStore>,
    source_lines: String,
    gen_flags: Vec<String>,
}

fn hdfs_source(name: &str) -> RemoteSource {
    let base = server_env("FERRY_TEST_HDFS_URL");
    let root = unique(name);
    Hdfs::connect(&base, None)
        .unwrap()
        .put_file(Path::new(&format!("{root}/README")), b"source root")
        .unwrap();
    let url = format!("{base}{root}");
    RemoteSource {
        store: Box::new(Hdfs::connect(&url, None).unwrap()),
        url,
        root,
        source_lines: String::new(),
        gen_flags: Vec::new(),
    }
}

fn s3_source(w: &World, name: &str) -> RemoteSource {
    let s3_url = server_env("FERRY_TEST_S3_URL");
    let (endpoint, bucket) = s3_url.rsplit_once('/').unwrap();
    let key_id = server_env("FERRY_TEST_S3_ACCESS_KEY_ID");
    let secret = server_env("FERRY_TEST_S3_SECRET_ACCESS_KEY");
    let secret_file = w.root.join("s3-source.secret");
    std::fs::write(&secret_file, format!("{secret}\n")).unwrap();
    let root = unique(name);
    let url = format!("s3://{bucket}{root}");
    let cfg = S3Config {
        endpoint: Some(endpoint.to_string()),
        region: None,
        access_key_id: Some(key_id.clone()),
        secret_access_key: Some(secret),
        capacity: None,
    };
    RemoteSource {
        store: Box::new(S3::connect(&format!("s3://{bucket}"), &cfg).unwrap()),
        url,
        root,
        source_lines: format!(
            "[source.s3]\nendpoint = {}\naccess_key_id = {}\nsecret_access_key_file = {}\n",
            toml_str(endpoint),
            toml_str(&key_id),
            toml_str(secret_file.to_str().unwrap()),
        ),
        gen_flags: vec![
            "--s3-endpoint".into(),
            endpoint.into(),
            "--s3-access-key-id".into(),
            key_id,
            "--s3-secret-access-key-file".into(),
            secret_file.to_str().unwrap().into(),
        ],
    }
}

/// `ferry gen --format FORMAT` writes a save into the watched remote
/// source root `src` while the source agent polls it; the checkpoint is
/// replicated to a sink of `kind`, byte-identical, published once, and
/// resolves from its source URL (to the replica's URL, or path).
async fn generated_save_is_watched_and_replicated(
    source_kind: SinkKind,
    format: &str,
    kind: SinkKind,
) {
    let name = format!(
        "{}-{format}",
        match source_kind {
            SinkKind::S3 => "s3-watched",
            _ => "hdfs-watched",
        }
    );
    let w = &World::new(&name).await;
    let src = &match source_kind {
        SinkKind::S3 => s3_source(w, &name),
        _ => hdfs_source(&name),
    };
    let job_url = format!("{}/{format}", src.url);
    let job_path = format!("{}/{format}", src.root);
    let sink = match kind {
        SinkKind::Posix => None,
        SinkKind::Hdfs => Some(hdfs_sink(&format!("sink-{format}"))),
        SinkKind::S3 => Some(s3_sink(w, &format!("sink-{format}"))),
    };
    let c = w
        .start_cluster("500Mbit/s", &[], |sink_cfg, src_cfg| {
            if let Some(r) = &sink {
                let spec = sink_cfg.sink.as_mut().unwrap();
                spec.root = PathBuf::from(&r.url);
                spec.extra = r.lines.clone();
            }
            let s = src_cfg.source.as_mut().unwrap();
            s.root = PathBuf::from(&job_url);
            s.scan_interval = "500ms".into();
            s.extra = format!("quiet_period = \"1s\"\n{}", src.source_lines);
        })
        .await;
    let mut args: Vec<String> = [
        "gen", "--format", format, "--size", "3MB", "--ranks", "2", "--out", &job_url,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(src.gen_flags.iter().cloned());
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = w.ferry(&argv, &[], TRANSFER).await;
    w.ensure(out.success(), || {
        format!("ferry gen --out {job_url}: {out}")
    });
    // The checkpoint directory the generator made.
    let listing = src.store.list(Path::new(&job_path), &[]).unwrap();
    let dir = listing
        .files
        .iter()
        .find_map(|f| f.info.path.split_once('/').map(|(d, _)| d.to_string()))
        .unwrap_or_else(|| w.fail(format!("ferry gen wrote no directory under {job_url}")));
    let ckpt_url = format!("{job_url}/{dir}");
    let ckpt_path = PathBuf::from(format!("{job_path}/{dir}"));
    let r = w
        .wait_until(
            &format!("{ckpt_url} to be replicated"),
            TRANSFER,
            async || {
                let r = w.try_resolve(&c.sink, Path::new(&ckpt_url)).await?;
                if s(&r, "state") == "local" {
                    Ok(r)
                } else {
                    Err(r.to_string())
                }
            },
        )
        .await;
    // Byte-identical: the same files, sizes and chunk hashes.
    let chunk = ferry_proto::manifest::MIN_CHUNK_SIZE;
    let original = build(&*src.store, &ckpt_path, &[], chunk).unwrap();
    let rel = format!("{SOURCE_SITE}/{JOB}/{dir}");
    let copy = match &sink {
        Some(r) => build(
            &*r.store,
            Path::new(&format!("{}/{rel}", r.root)),
            &[],
            chunk,
        ),
        None => build(&Posix, &w.sink_root().join(&rel), &[], chunk),
    }
    .unwrap_or_else(|e| w.fail(format!("{format}: reading the replica: {e}")));
    let files = |m: &Manifest| {
        let mut v: Vec<_> = m
            .files
            .iter()
            .map(|f| (f.path.clone(), f.size, f.chunks.clone()))
            .collect();
        v.sort();
        v
    };
    w.ensure(files(&copy) == files(&original), || {
        format!("{format}: the replica of {ckpt_url} differs from it")
    });
    let want = match &sink {
        Some(r) => format!("{}/{rel}", r.url),
        None => w.sink_root().join(&rel).to_string_lossy().into_owned(),
    };
    let got = r["url"].as_str().or(r["local_path"].as_str()).unwrap_or("");
    w.ensure(got == want, || {
        format!("{format}: resolve {r}, want {want}")
    });
    // Published once.
    let ts = w.transfers(&c.source).await;
    let published = ts.iter().filter(|t| s(t, "state") == "published").count();
    w.ensure(published == 1 && ts.len() == 1, || {
        format!("{format}: expected one published transfer: {ts:?}")
    });
    println!("{format}: {ckpt_url} -> {want}");
}

/// DCP, HF and DeepSpeed saves written by the generator into a watched
/// HDFS source root are replicated to an HDFS, an S3 and a POSIX sink.
#[tokio::test]
async fn saves_generated_into_an_hdfs_root_are_watched_and_replicated() {
    generated_save_is_watched_and_replicated(SinkKind::Hdfs, "dcp", SinkKind::Hdfs).await;
    generated_save_is_watched_and_replicated(SinkKind::Hdfs, "hf", SinkKind::S3).await;
    generated_save_is_watched_and_replicated(SinkKind::Hdfs, "deepspeed", SinkKind::Posix).await;
}

/// The same from a watched S3 source root, each format to another kind
/// of sink.
#[tokio::test]
async fn saves_generated_into_an_s3_root_are_watched_and_replicated() {
    generated_save_is_watched_and_replicated(SinkKind::S3, "dcp", SinkKind::S3).await;
    generated_save_is_watched_and_replicated(SinkKind::S3, "hf", SinkKind::Posix).await;
    generated_save_is_watched_and_replicated(SinkKind::S3, "deepspeed", SinkKind::Hdfs).await;
}
