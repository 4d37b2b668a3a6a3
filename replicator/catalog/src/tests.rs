//! The catalog's behaviour on a real SQLite file, table by table.
#![allow(clippy::unwrap_used)]

use std::str::FromStr;

use ferry_proto::manifest::{FileInfo, Hash};
use ferry_proto::state::{Profile, TransferId, TransferState};
use scheduler::Class;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};

use crate::chunks::spread_arrivals;
use crate::dialect::Dialect;
use crate::*;

/// A catalog for one test: SQLite in a temporary directory, or a
/// PostgreSQL database of its own, created on the server at
/// `FERRY_TEST_PG_URL` (set by `ops/test`) and dropped when the test ends.
pub(crate) struct TestCatalog {
    pub(crate) catalog: Catalog,
    _dir: tempfile::TempDir,
    pg: Option<(PostgresUrl, String)>,
}

/// Where the test PostgreSQL server is; a test asking for it fails
/// (never skips) when the test command did not start one.
pub(crate) fn test_pg_url() -> PostgresUrl {
    let url = std::env::var("FERRY_TEST_PG_URL").unwrap_or_else(|_| {
        panic!(
            "FERRY_TEST_PG_URL is not set: the PostgreSQL catalog tests need a server; run them \
             through ops/test (or ops/with-test-pg cargo test ...), which starts one"
        )
    });
    PostgresUrl::parse(&url).unwrap_or_else(|e| panic!("FERRY_TEST_PG_URL: {e}"))
}

/// A fresh, empty database on the test server: its admin URL and name.
pub(crate) async fn fresh_pg_database() -> (PostgresUrl, String, PostgresUrl) {
    use sqlx::Connection;
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let admin = test_pg_url();
    let name = format!(
        "ferry_test_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        now_ms()
    );
    let mut conn = sqlx::PgConnection::connect(admin.secret())
        .await
        .unwrap_or_else(|e| panic!("test PostgreSQL at {admin}: {e}"));
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
    let url = admin.with_database(&name);
    (admin, name, url)
}

/// Drops a test database (its connections too).
pub(crate) async fn drop_pg_database(admin: &PostgresUrl, name: &str) {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(admin.secret()).await.unwrap();
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
}

impl TestCatalog {
    /// The site PostgreSQL test catalogs are recorded for.
    pub(crate) const SITE: &str = "test-site";

    pub(crate) async fn new(db: Dialect) -> TestCatalog {
        let dir = tempfile::tempdir().unwrap();
        match db {
            Dialect::Sqlite => TestCatalog {
                catalog: Catalog::open(dir.path()).await.unwrap(),
                _dir: dir,
                pg: None,
            },
            Dialect::Postgres => {
                let (admin, name, url) = fresh_pg_database().await;
                TestCatalog {
                    catalog: Catalog::open_postgres(&url, Self::SITE).await.unwrap(),
                    _dir: dir,
                    pg: Some((admin, name)),
                }
            }
        }
    }

    /// Closes the catalog and drops its PostgreSQL database.
    pub(crate) async fn finish(self) {
        self.catalog.close().await;
        if let Some((admin, name)) = &self.pg {
            drop_pg_database(admin, name).await;
        }
    }
}

/// Runs `body` on a fresh catalog of dialect `db`.
pub(crate) async fn run_on<F, Fut>(db: Dialect, body: F)
where
    F: FnOnce(Catalog) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let t = TestCatalog::new(db).await;
    body(t.catalog.clone()).await;
    t.finish().await;
}

/// The conformance suite: `both!(name)` makes the test `name::sqlite`
/// and `name::postgres` of `async fn name(c: Catalog)`, run on a fresh
/// catalog of each dialect.
macro_rules! both {
    ($name:ident) => {
        mod $name {
            #[tokio::test]
            async fn sqlite() {
                $crate::tests::run_on($crate::dialect::Dialect::Sqlite, super::$name).await
            }
            #[tokio::test]
            async fn postgres() {
                $crate::tests::run_on($crate::dialect::Dialect::Postgres, super::$name).await
            }
        }
    };
}

mod events;
mod pool;
mod settings;

#[tokio::test]
async fn second_agent_on_one_data_dir_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let _c = Catalog::open(d.path()).await.unwrap();
    let e = Catalog::open(d.path()).await.unwrap_err();
    assert!(e.to_string().contains("already in use"), "{e}");
}

async fn pause_and_final_states_are_not_undone_by_the_transfer_task(c: Catalog) {
    let state_of = |id| {
        let c = c.clone();
        async move { c.transfer(id).await.unwrap().unwrap().state }
    };
    let id = c
        .insert_transfer("l", "j", "/ck/s1", "s1", Class::Scheduled)
        .await
        .unwrap();
    c.set_transfer_state(id, TransferState::Paused, None)
        .await
        .unwrap();
    for s in [TransferState::Active, TransferState::Verifying] {
        let took = c.set_transfer_state(id, s, None).await.unwrap();
        assert!(!took, "a refused {s} says so");
        assert_eq!(state_of(id).await, TransferState::Paused, "after {s}");
    }
    assert!(
        c.transfer(id).await.unwrap().unwrap().started_at.is_none(),
        "a refused active does not count as a start"
    );
    c.set_transfer_state(id, TransferState::Queued, None)
        .await
        .unwrap();
    assert_eq!(state_of(id).await, TransferState::Queued, "resumed");
    assert!(c
        .set_transfer_state(id, TransferState::Active, None)
        .await
        .unwrap());
    assert_eq!(state_of(id).await, TransferState::Active);
    assert!(c.transfer(id).await.unwrap().unwrap().started_at.is_some());
    assert!(
        c.set_transfer_state(id, TransferState::Active, None)
            .await
            .unwrap(),
        "active again (a resumed run) is taken"
    );
    c.set_transfer_state(id, TransferState::Paused, None)
        .await
        .unwrap();
    c.set_transfer_state(id, TransferState::Cancelled, Some("by hand"))
        .await
        .unwrap();
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!(
        t.state,
        TransferState::Cancelled,
        "a paused transfer can be cancelled"
    );
    let finished = t.finished_at;
    assert!(finished.is_some());
    for s in [
        TransferState::Active,
        TransferState::Verifying,
        TransferState::Queued,
        TransferState::Failed,
    ] {
        assert!(!c.set_transfer_state(id, s, Some("late")).await.unwrap());
        let t = c.transfer(id).await.unwrap().unwrap();
        assert_eq!(t.state, TransferState::Cancelled, "after {s}");
        assert_eq!(
            (t.error.as_deref(), t.finished_at),
            (Some("by hand"), finished)
        );
    }
    // A paused transfer may still fail.
    let id = c
        .insert_transfer("l", "j", "/ck/s2", "s2", Class::Scheduled)
        .await
        .unwrap();
    c.set_transfer_state(id, TransferState::Paused, None)
        .await
        .unwrap();
    c.set_transfer_state(id, TransferState::Failed, Some("gone"))
        .await
        .unwrap();
    assert_eq!(state_of(id).await, TransferState::Failed);
}
both!(pause_and_final_states_are_not_undone_by_the_transfer_task);

/// A run's start takes `active` and clears the note in one write, with
/// the same refusals as any `active`: never over a pause or a final state.
async fn a_run_start_clears_the_note_and_respects_pauses(c: Catalog) {
    let id = c
        .insert_transfer("l", "j", "/ck/s1", "s1", Class::Scheduled)
        .await
        .unwrap();
    c.set_transfer_note(id, Some("link down")).await.unwrap();
    c.set_transfer_state(id, TransferState::Paused, None)
        .await
        .unwrap();
    assert!(!c.set_transfer_active(id).await.unwrap(), "paused");
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!((t.state, t.started_at), (TransferState::Paused, None));
    assert_eq!(t.error.as_deref(), Some("link down"));
    c.set_transfer_state(id, TransferState::Queued, None)
        .await
        .unwrap();
    assert!(c.set_transfer_active(id).await.unwrap());
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!((t.state, t.error), (TransferState::Active, None));
    let started = t.started_at.unwrap();
    c.set_transfer_state(id, TransferState::Queued, None)
        .await
        .unwrap();
    assert!(c.set_transfer_active(id).await.unwrap());
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!(t.started_at, Some(started), "the first start is kept");
    c.set_transfer_state(id, TransferState::Failed, Some("x"))
        .await
        .unwrap();
    assert!(!c.set_transfer_active(id).await.unwrap(), "final");
    assert_eq!(
        c.transfer(id).await.unwrap().unwrap().state,
        TransferState::Failed
    );
}
both!(a_run_start_clears_the_note_and_respects_pauses);

/// A pushed transfer is inserted with its size (when known) and its
/// arrival event, and the row returned is the row stored.
async fn a_pushed_transfer_is_inserted_with_its_size_and_returned(c: Catalog) {
    let t = c
        .insert_pushed_transfer("l", "j", "/ck/a", "a", Class::Urgent, Some((4096, 2)))
        .await
        .unwrap();
    assert_eq!((t.bytes_total, t.shards, t.bytes_done), (4096, 2, 0));
    assert_eq!((t.state, t.class), (TransferState::Queued, Class::Urgent));
    assert_eq!(c.transfer(t.id).await.unwrap().unwrap(), t);
    let u = c
        .insert_pushed_transfer("l", "j", "/ck/b", "b", Class::Scheduled, None)
        .await
        .unwrap();
    assert_eq!((u.bytes_total, u.shards), (0, 0));
    assert_ne!(t.id, u.id);
    let arrivals = c
        .events_since(0)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| matches!(e.change, Change::Arrival { .. }))
        .count();
    assert_eq!(arrivals, 2, "each insert records its arrival");
}
both!(a_pushed_transfer_is_inserted_with_its_size_and_returned);

async fn transfer_progress_never_moves_backwards(c: Catalog) {
    let id = c
        .insert_transfer("l", "j", "/ck/s1", "s1", Class::Scheduled)
        .await
        .unwrap();
    let row = |c: Catalog| async move {
        let t = c.transfer(id).await.unwrap().unwrap();
        (t.bytes_total, t.bytes_done, t.bytes_sent, t.shards)
    };
    let note = |total, done, sent| ProgressNote {
        bytes_total: total,
        bytes_done: done,
        bytes_sent: sent,
    };
    // A checkpoint being written: the size known so far grows.
    c.note_transfer_progress(id, note(100, 40, 50))
        .await
        .unwrap();
    assert_eq!(row(c.clone()).await, (100, 40, 50, 0));
    // A later run that knows less (it just started) changes nothing.
    c.note_transfer_progress(id, note(60, 10, 20))
        .await
        .unwrap();
    assert_eq!(row(c.clone()).await, (100, 40, 50, 0));
    c.note_transfer_progress(id, note(150, 400, 160))
        .await
        .unwrap();
    assert_eq!(row(c.clone()).await, (150, 150, 160, 0), "done <= total");
    // The sealed size is exact; what is done stays within it.
    c.set_transfer_size(id, 120, 3).await.unwrap();
    assert_eq!(row(c.clone()).await, (120, 120, 160, 3));
    c.set_transfer_size(id, 200, 3).await.unwrap();
    assert_eq!(row(c.clone()).await, (200, 120, 160, 3));
}
both!(transfer_progress_never_moves_backwards);

async fn transfer_and_replica_rows_roundtrip(c: Catalog) {
    let id = c
        .insert_transfer("l", "j", "/ck/s1", "s1", Class::Scheduled)
        .await
        .unwrap();
    c.set_transfer_state(id, TransferState::Active, None)
        .await
        .unwrap();
    assert_eq!(c.unfinished_transfers().await.unwrap().len(), 1);
    assert_eq!(
        c.transfer_state_counts().await.unwrap(),
        vec![(TransferState::Active, 1)]
    );
    c.set_transfer_published(id, "ab", "/eval/x").await.unwrap();
    assert_eq!(
        c.transfer_state_counts().await.unwrap(),
        vec![(TransferState::Published, 1)]
    );
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!(t.state, TransferState::Published);
    assert!(t.started_at.is_some() && t.finished_at.is_some());
    assert!(c.unfinished_transfers().await.unwrap().is_empty());

    let files = vec![FileInfo {
        path: "a".into(),
        size: 5,
        mode: 0o644,
        mtime_ns: 1,
    }];
    let r = c
        .insert_replica(&NewReplica {
            peer: "p",
            source_site: "s",
            source_transfer: id,
            job: "j",
            source_path: "/ck/s1",
            rel: "s1",
            chunk_size: 1 << 20,
            files: &files,
            bytes_total: 5,
            staging_path: "/st",
            local_path: "/eval/x",
            profile: Profile::WeightsOnly,
        })
        .await
        .unwrap();
    assert_eq!(c.replica_files(r).await.unwrap(), files);
    c.add_chunks(&[vc(r, 0, [7; 32], 5)]).await.unwrap();
    c.add_chunks(&[vc(r, 0, [7; 32], 5)]).await.unwrap();
    assert_eq!(c.chunks(r).await.unwrap(), vec![(0, [7; 32])]);
    let part = PartRange {
        part: 0,
        first_key: 0,
        end_key: 1,
        bytes: 5,
    };
    c.register_part_epoch(r, part, 1, "a").await.unwrap();
    assert_eq!(
        c.replica_state_counts().await.unwrap(),
        vec![(TransferState::Receiving, 1)]
    );
    let times = SourceTimes {
        committed_ms: now_ms() - 2_000,
        opened_ms: now_ms() - 5_000,
    };
    let stored_lag = c
        .set_replica_published(
            r,
            b"m",
            "ab",
            "/eval/x",
            5,
            times,
            CheckpointMeta {
                step: Some(1200),
                class: Some(scheduler::Class::Urgent),
                readers: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(
        c.replica_state_counts().await.unwrap(),
        vec![(TransferState::Published, 1)]
    );
    assert!(c.chunks(r).await.unwrap().is_empty());
    // Its parts' epochs go with the chunk rows.
    assert!(c.part_epochs(r, None).await.unwrap().is_empty());
    let rep = c.replica_by_local_path("/eval/x").await.unwrap().unwrap();
    assert_eq!(rep.bytes_done, 5);
    assert_eq!(rep.profile, Profile::WeightsOnly);
    assert_eq!(rep.committed_at, Some(times.committed_ms));
    let lag = rep.commit_to_replica_s.unwrap();
    assert_eq!(stored_lag, Some(lag), "the lag returned is the one stored");
    let open = rep.open_to_replica_s.unwrap();
    assert!(
        (2.0..60.0).contains(&lag) && (5.0..60.0).contains(&open),
        "{lag} {open}"
    );
    assert_eq!(c.replica_manifest(r).await.unwrap().unwrap(), b"m");
    assert_eq!(rep.step, Some(1200));
    assert_eq!(rep.class, Some(scheduler::Class::Urgent));
    assert_eq!((rep.pin.clone(), rep.removal.clone()), (None, None));
}
both!(transfer_and_replica_rows_roundtrip);

/// Pins, the current versions at a path, and a removal's two steps.
async fn replica_pins_and_removals_are_recorded(c: Catalog) {
    let mut ids = Vec::new();
    for (n, path) in [(1, "/eval/a"), (2, "/eval/a"), (3, "/eval/b")] {
        let r = replica_for(&c, TransferId(n)).await;
        c.set_replica_published(
            r,
            b"m",
            "ab",
            path,
            10 * n,
            SourceTimes::default(),
            CheckpointMeta::default(),
        )
        .await
        .unwrap();
        ids.push(r);
    }
    // The first was replaced at /eval/a by the second.
    let current: Vec<i64> = c
        .current_replicas()
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(current, vec![ids[1], ids[2]]);
    assert!(c.pin_replica(ids[2], None, "bisecting").await.unwrap());
    assert_eq!(c.pinned_replica_count(now_ms()).await.unwrap(), 1);
    let pin = c.replica(ids[2]).await.unwrap().unwrap().pin.unwrap();
    assert_eq!((pin.until, pin.reason.as_str()), (None, "bisecting"));
    assert!(c.unpin_replica(ids[2]).await.unwrap());
    assert!(!c.unpin_replica(ids[2]).await.unwrap(), "nothing to unpin");
    assert!(
        !c.pin_replica(9999, None, "x").await.unwrap(),
        "no such replica"
    );
    // An expired pin does not count.
    assert!(c
        .pin_replica(ids[2], Some(now_ms() - 1), "old")
        .await
        .unwrap());
    assert_eq!(c.pinned_replica_count(now_ms()).await.unwrap(), 0);

    assert!(c
        .begin_replica_removal(ids[1], RemovalReason::Operator, "full disk", true, 20)
        .await
        .unwrap());
    assert!(
        !c.begin_replica_removal(ids[1], RemovalReason::Rule, "x", false, 20)
            .await
            .unwrap(),
        "a removal begins once"
    );
    assert_eq!(c.replicas_removing().await.unwrap().len(), 1);
    c.finish_replica_removal(ids[1]).await.unwrap();
    let r = c.replica(ids[1]).await.unwrap().unwrap();
    assert_eq!(r.state, TransferState::Removed);
    let rm = r.removal.unwrap();
    assert_eq!(rm.reason, RemovalReason::Operator);
    assert_eq!(
        (rm.detail.as_str(), rm.bytes, rm.forced),
        ("full disk", 20, true)
    );
    assert!(rm.finished_at.unwrap() >= rm.started_at);
    assert!(c.replicas_removing().await.unwrap().is_empty());
    let removed = c
        .replicas_in(Some(TransferState::Removed), 10, 0)
        .await
        .unwrap();
    assert_eq!(removed.len(), 1);
    // The removed version leaves the current ones, and the one it
    // replaced does not come back (its bytes went with the re-save).
    let current: Vec<i64> = c
        .current_replicas()
        .await
        .unwrap()
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(current, vec![ids[2]]);
    // Every version the path held, oldest first, with its state.
    let at = c.replica_versions_at("/eval/a").await.unwrap();
    assert_eq!(
        at,
        vec![
            (ids[0], TransferState::Published),
            (ids[1], TransferState::Removed)
        ]
    );
    assert!(c.replica_versions_at("/nowhere").await.unwrap().is_empty());
}
both!(replica_pins_and_removals_are_recorded);

/// Leases: grant, renew, release, expiry, and their effect on removals
/// and on deleting a replaced version.
async fn reader_leases_hold_a_version(c: Catalog) {
    let mut ids = Vec::new();
    for n in 1..=3 {
        ids.push(published_at(&c, n, "/eval/a").await);
    }
    let l = c
        .grant_lease(ids[0], "eval", 60_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(l.id.len(), 32);
    assert!(l.live_at(now_ms()));
    assert_eq!(c.lease(&l.id).await.unwrap().unwrap(), l);
    let r = c.replica(ids[0]).await.unwrap().unwrap();
    assert_eq!(r.leased_until, Some(l.expires_at));
    assert!(r.leased_at(now_ms()));
    assert_eq!(c.leased_replica_count(now_ms()).await.unwrap(), 1);
    // A leased version is neither removed nor deleted as replaced...
    assert!(!c
        .begin_replica_removal(ids[0], RemovalReason::Rule, "x", false, 1)
        .await
        .unwrap());
    assert!(!c.claim_replaced_version(ids[0]).await.unwrap());
    // ...but an operator's forced removal goes ahead.
    let l2 = c
        .grant_lease(ids[1], "eval", 60_000)
        .await
        .unwrap()
        .unwrap();
    assert!(c
        .begin_replica_removal(ids[1], RemovalReason::Operator, "x", true, 1)
        .await
        .unwrap());
    // No lease on a version being removed, or whose directory went.
    assert!(c.grant_lease(ids[1], "eval", 1000).await.unwrap().is_none());
    assert!(c.claim_replaced_version(ids[2]).await.unwrap());
    assert!(!c.claim_replaced_version(ids[2]).await.unwrap(), "once");
    assert!(c.grant_lease(ids[2], "eval", 1000).await.unwrap().is_none());
    assert!(c.grant_lease(9999, "eval", 1000).await.unwrap().is_none());
    // Renewal extends from now; release ends it and the row's expiry
    // falls back to the other leases'.
    let other = c.grant_lease(ids[0], "b", 5_000).await.unwrap().unwrap();
    let renewed = c.renew_lease(&l.id).await.unwrap().unwrap();
    assert!(renewed.expires_at >= l.expires_at);
    let released = c.release_lease(&l.id).await.unwrap().unwrap();
    assert!(released.released_at.is_some());
    assert_eq!(
        c.replica(ids[0]).await.unwrap().unwrap().leased_until,
        Some(other.expires_at)
    );
    assert!(matches!(
        c.renew_lease(&l.id).await.unwrap(),
        Err(LeaseProblem::Released(_))
    ));
    assert!(matches!(
        c.release_lease(&l.id).await.unwrap(),
        Err(LeaseProblem::Released(_))
    ));
    assert_eq!(
        c.renew_lease("00000000000000000000000000000000")
            .await
            .unwrap(),
        Err(LeaseProblem::Unknown)
    );
    c.release_lease(&other.id).await.unwrap().unwrap();
    assert_eq!(c.replica(ids[0]).await.unwrap().unwrap().leased_until, None);
    assert!(c
        .live_leases(now_ms())
        .await
        .unwrap()
        .iter()
        .all(|x| x.id == l2.id));
    // An expired lease cannot be renewed, and no longer holds its version.
    let short = c.grant_lease(ids[0], "eval", 1).await.unwrap().unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    assert!(matches!(
        c.renew_lease(&short.id).await.unwrap(),
        Err(LeaseProblem::Expired(_))
    ));
    assert!(c.claim_replaced_version(ids[0]).await.unwrap());
    // Ended leases are forgotten a day later.
    assert_eq!(
        c.forget_ended_leases(now_ms() + LEASE_MEMORY_MS + 120_000)
            .await
            .unwrap(),
        4
    );
    assert!(c.lease(&short.id).await.unwrap().is_none());
}
both!(reader_leases_hold_a_version);

/// A lease granted while a removal begins on the same version: exactly
/// one of them wins, decided on the row.
async fn a_lease_and_a_removal_at_once_never_both_win(c: Catalog) {
    for n in 0..20 {
        let r = published_at(&c, 100 + n, &format!("/eval/{n}")).await;
        let (c1, c2) = (c.clone(), c.clone());
        let (lease, removal) = tokio::join!(
            async move { c1.grant_lease(r, "eval", 60_000).await.unwrap() },
            async move {
                c2.begin_replica_removal(r, RemovalReason::Rule, "x", false, 1)
                    .await
                    .unwrap()
            }
        );
        assert!(
            lease.is_some() != removal,
            "round {n}: lease {lease:?}, removal {removal}"
        );
    }
}
both!(a_lease_and_a_removal_at_once_never_both_win);

/// Pin requests: recorded with their target, pending until applied or
/// ended; applying never shortens a longer pin.
async fn pin_requests_are_kept_until_applied(c: Catalog) {
    use ferry_proto::wire::PinTarget;
    let now = now_ms();
    let a = c
        .record_pin_request(
            "train-a",
            "j",
            PinTarget::AtOrAfter(350),
            "spike",
            now + 60_000,
        )
        .await
        .unwrap();
    let b = c
        .record_pin_request("train-a", "j", PinTarget::Newest, "spike", now + 1)
        .await
        .unwrap();
    let s = c
        .record_pin_request("train-a", "j", PinTarget::Step(u64::MAX), "x", now + 60_000)
        .await
        .unwrap();
    let pending = c.pending_pin_requests(now).await.unwrap();
    assert_eq!(
        pending.iter().map(|p| p.id).collect::<Vec<_>>(),
        vec![a, b, s]
    );
    assert_eq!(pending[0].target, PinTarget::AtOrAfter(350));
    assert_eq!(pending[1].target, PinTarget::Newest);
    // A step past i64 is stored as the largest one.
    assert_eq!(pending[2].target, PinTarget::Step(i64::MAX as u64));
    // Ended requests are no longer pending.
    let later = c.pending_pin_requests(now + 2).await.unwrap();
    assert_eq!(later.iter().map(|p| p.id).collect::<Vec<_>>(), vec![a, s]);
    // Applied to a published replica pinned by hand until unpinned: the
    // operator's pin stays, the request is done.
    let r = published_at(&c, 1, "/eval/a").await;
    assert!(c.pin_replica(r, None, "by hand").await.unwrap());
    assert!(!c
        .apply_pin_request(a, r, now + 60_000, "spike")
        .await
        .unwrap());
    assert_eq!(
        c.replica(r).await.unwrap().unwrap().pin.unwrap().reason,
        "by hand"
    );
    // A shorter pin is extended by a signal's.
    assert!(c.pin_replica(r, Some(now + 10), "short").await.unwrap());
    assert!(c
        .apply_pin_request(s, r, now + 60_000, "spike")
        .await
        .unwrap());
    let pin = c.replica(r).await.unwrap().unwrap().pin.unwrap();
    assert_eq!(
        (pin.reason.as_str(), pin.until),
        ("spike", Some(now + 60_000))
    );
    assert!(c
        .pending_pin_requests(now)
        .await
        .unwrap()
        .iter()
        .all(|p| p.id == b));
}
both!(pin_requests_are_kept_until_applied);

/// A re-save of a pinned checkpoint stays pinned; an unpinned or expired
/// predecessor passes nothing on, and an own pin is kept.
async fn a_re_save_keeps_the_pin_of_the_version_it_replaces(c: Catalog) {
    let now = now_ms();
    let v1 = published_at(&c, 1, "/eval/a").await;
    assert!(c
        .pin_replica(v1, Some(now + 60_000), "spike")
        .await
        .unwrap());
    let v2 = published_at(&c, 2, "/eval/a").await;
    assert!(c.carry_pin(v2, "/eval/a", now).await.unwrap());
    let pin = c.replica(v2).await.unwrap().unwrap().pin.unwrap();
    assert_eq!(
        (pin.reason.as_str(), pin.until),
        ("spike", Some(now + 60_000))
    );
    assert!(!c.carry_pin(v2, "/eval/a", now).await.unwrap(), "once");
    // Unpinned, v2 passes nothing to v3 (v1's old pin does not come back).
    assert!(c.unpin_replica(v2).await.unwrap());
    let v3 = published_at(&c, 3, "/eval/a").await;
    assert!(!c.carry_pin(v3, "/eval/a", now).await.unwrap());
    // An expired pin is not carried; another path's pin neither.
    assert!(c.pin_replica(v3, Some(now - 1), "old").await.unwrap());
    let v4 = published_at(&c, 4, "/eval/a").await;
    assert!(!c.carry_pin(v4, "/eval/a", now).await.unwrap());
    let b = published_at(&c, 5, "/eval/b").await;
    assert!(!c.carry_pin(b, "/eval/b", now).await.unwrap());
}
both!(a_re_save_keeps_the_pin_of_the_version_it_replaces);

/// A replica of source transfer `n` published at `local_path` (10 bytes).
async fn published_at(c: &Catalog, n: u64, local_path: &str) -> i64 {
    let r = replica_for(c, TransferId(n)).await;
    c.set_replica_published(
        r,
        b"m",
        "ab",
        local_path,
        10,
        SourceTimes::default(),
        CheckpointMeta::default(),
    )
    .await
    .unwrap();
    r
}

async fn replica_for(c: &Catalog, id: TransferId) -> i64 {
    c.insert_replica(&NewReplica {
        peer: "p",
        source_site: "s",
        source_transfer: id,
        job: "j",
        source_path: "/ck/s1",
        rel: "s1",
        chunk_size: 1 << 20,
        files: &[],
        bytes_total: 10,
        staging_path: "/st",
        local_path: "/eval/x",
        profile: Profile::Full,
    })
    .await
    .unwrap()
}

fn vc(replica: i64, key: u64, hash: Hash, bytes: u64) -> VerifiedChunk {
    VerifiedChunk {
        replica,
        key,
        hash,
        bytes,
        arrived_ms: None,
        arrival_started_ms: None,
    }
}

#[test]
fn a_chunk_s_bytes_are_spread_over_its_arrival() {
    // 300 bytes from 1005 to 1035: 5/30, 10/30, 10/30, 5/30 of them in
    // the bins at 1000, 1010, 1020, 1030; a chunk with no start time
    // lands in its last byte's bin.
    let a = spread_arrivals(&[(Some(1005), 1035, 300), (None, 1021, 7)]);
    assert_eq!(a.bin_ms, 10);
    assert_eq!(
        a.bins,
        vec![(1000, 50), (1010, 100), (1020, 107), (1030, 50)]
    );
    assert_eq!(a.bytes_between(1000, 1040), 307);
    // A long transfer gets wider bins.
    let long = spread_arrivals(&[(Some(0), 1, 1), (None, 500_000, 1)]);
    assert_eq!(long.bin_ms, 100);
}

async fn add_chunks_records_arrival_time_and_length(c: Catalog) {
    let r = replica_for(&c, TransferId(1)).await;
    let before = now_ms();
    c.add_chunks(&[vc(r, 0, [1; 32], 7), vc(r, 1, [2; 32], 3)])
        .await
        .unwrap();
    let after = now_ms();
    // A repeat keeps the first arrival and does not count twice.
    c.add_chunks(&[vc(r, 0, [1; 32], 99)]).await.unwrap();
    // An arrival time given is kept as given.
    c.add_chunks(&[VerifiedChunk {
        arrived_ms: Some(before - 5_003),
        ..vc(r, 2, [3; 32], 4)
    }])
    .await
    .unwrap();
    assert_eq!(
        c.chunk_arrivals(r).await.unwrap().bins.first(),
        Some(&((before - 5_003) / 10 * 10, 4))
    );
    let rows: Vec<(i64, Option<i64>, Option<i64>)> = sqlx::query_as(&c.db.sql(
        "SELECT idx, verified_at, bytes FROM chunks WHERE replica = ? AND idx < 2 ORDER BY idx",
    ))
    .bind(r)
    .fetch_all(&c.pool)
    .await
    .unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!((rows[0].0, rows[0].2), (0, Some(7)));
    assert_eq!((rows[1].0, rows[1].2), (1, Some(3)));
    for (_, at, _) in &rows {
        let at = at.unwrap();
        assert!((before..=after).contains(&at), "{before} {at} {after}");
    }
    assert_eq!(c.replica(r).await.unwrap().unwrap().bytes_done, 14);
}
both!(add_chunks_records_arrival_time_and_length);

/// A sink-side row at `local_path` in `state`.
async fn replica_at(c: &Catalog, id: u64, local_path: &str, state: TransferState) -> i64 {
    let r = c
        .insert_replica(&NewReplica {
            peer: "p",
            source_site: "s",
            source_transfer: TransferId(id),
            job: "j",
            source_path: &format!("/ck/{id}"),
            rel: "x",
            chunk_size: 1 << 20,
            files: &[],
            bytes_total: 10,
            staging_path: "/st",
            local_path,
            profile: Profile::Full,
        })
        .await
        .unwrap();
    c.set_replica_state(r, state, None).await.unwrap();
    r
}

/// A replica path overlaps a live or published one above or below it,
/// never a sibling with the same prefix, a failed row or itself; the
/// ancestors of a path deeper than one statement's share are all asked.
async fn overlapping_replicas_are_found_above_and_below(c: Catalog) {
    replica_at(&c, 1, "/eval/a/b", TransferState::Receiving).await;
    replica_at(&c, 2, "/eval/f", TransferState::Failed).await;
    replica_at(&c, 3, "/deep", TransferState::Published).await;
    let over = |p: String| {
        let c = c.clone();
        async move { c.overlapping_replica(&p).await.unwrap() }
    };
    assert_eq!(over("/eval/a".into()).await.as_deref(), Some("/eval/a/b"));
    assert_eq!(over("/eval/a/".into()).await.as_deref(), Some("/eval/a/b"));
    assert_eq!(
        over("/eval/a/b/c/d".into()).await.as_deref(),
        Some("/eval/a/b")
    );
    assert_eq!(over("/eval/a/b".into()).await, None, "itself");
    assert_eq!(over("/eval/a/bc".into()).await, None, "a sibling");
    assert_eq!(over("/eval/a/b0".into()).await, None, "a sibling");
    assert_eq!(over("/eval/f/g".into()).await, None, "a failed row");
    assert_eq!(over("/eval".into()).await.as_deref(), Some("/eval/a/b"));
    let deep = format!("/deep{}", "/d".repeat(2 * MAX_DEPTH_TESTED));
    assert_eq!(over(deep).await.as_deref(), Some("/deep"));
    assert_eq!(over(format!("/other{}", "/d".repeat(900))).await, None);
}
both!(overlapping_replicas_are_found_above_and_below);

/// More ancestors than one statement of `overlapping_replica` asks for.
const MAX_DEPTH_TESTED: usize = 500;

/// Chunks and publishes recorded in one batch: each publish gets its
/// manifest, its arrival bins (from chunks of the same batch too) and
/// loses its chunk rows; a row still receiving keeps its chunks and
/// counts their bytes.
async fn a_batch_records_chunks_and_publishes_together(c: Catalog) {
    let r1 = replica_at(&c, 1, "/eval/1", TransferState::Receiving).await;
    let r2 = replica_at(&c, 2, "/eval/2", TransferState::Receiving).await;
    let r3 = replica_at(&c, 3, "/eval/3", TransferState::Receiving).await;
    let at = now_ms() - 60_000;
    c.add_chunks(&[VerifiedChunk {
        arrived_ms: Some(at),
        ..vc(r2, 0, [2; 32], 6)
    }])
    .await
    .unwrap();
    let published = |id: i64, root: &str, committed_ms: i64| PublishedReplica {
        id,
        manifest: root.as_bytes().to_vec(),
        root_hex: root.into(),
        local_path: format!("/eval/{id}"),
        bytes: 10,
        times: SourceTimes {
            committed_ms,
            opened_ms: 0,
        },
        meta: CheckpointMeta {
            step: Some(7),
            class: Some(Class::Background),
            readers: None,
        },
        phases: None,
    };
    let lags = c
        .record_batch(
            &[
                VerifiedChunk {
                    arrived_ms: Some(at + 1_000),
                    ..vc(r1, 0, [1; 32], 4)
                },
                vc(r3, 0, [3; 32], 5),
            ],
            &[
                published(r1, "aa", now_ms() - 3_000),
                published(r2, "bb", 0),
            ],
        )
        .await
        .unwrap();
    assert_eq!(lags.len(), 2);
    assert!(
        lags[0].is_some_and(|l| (3.0..60.0).contains(&l)),
        "{lags:?}"
    );
    assert_eq!(lags[1], None, "commit time unknown");
    for (r, root, bin) in [(r1, "aa", at + 1_000), (r2, "bb", at)] {
        let row = c.replica(r).await.unwrap().unwrap();
        assert_eq!(row.state, TransferState::Published, "{row:?}");
        assert_eq!(row.manifest_root.as_deref(), Some(root));
        assert_eq!((row.bytes_done, row.step), (10, Some(7)));
        assert_eq!(row.class, Some(Class::Background));
        assert_eq!(row.commit_to_replica_s, lags[(r == r2) as usize]);
        assert_eq!(
            c.replica_manifest(r).await.unwrap().unwrap(),
            root.as_bytes()
        );
        assert!(c.chunks(r).await.unwrap().is_empty());
        let arrivals = c.chunk_arrivals(r).await.unwrap();
        assert_eq!(arrivals.bins.first().map(|b| b.0), Some(bin / 10 * 10));
    }
    let row3 = c.replica(r3).await.unwrap().unwrap();
    assert_eq!(row3.state, TransferState::Receiving);
    assert_eq!(row3.bytes_done, 5);
    assert_eq!(c.chunks(r3).await.unwrap(), vec![(0, [3; 32])]);
    // The same publish recorded again (a sink agent of the pool that
    // waited on the catalog while another took the publish over) changes
    // nothing: not the row, its arrival bins or its publish events.
    let events = c.replica_events_after(0, 100).await.unwrap().len();
    let before = c.replica(r1).await.unwrap().unwrap();
    let bins = c.chunk_arrivals(r1).await.unwrap();
    let again = c
        .record_batch(&[], &[published(r1, "cc", now_ms() - 1_000)])
        .await
        .unwrap();
    assert_eq!(again, vec![None]);
    assert_eq!(c.replica(r1).await.unwrap().unwrap(), before);
    assert_eq!(c.chunk_arrivals(r1).await.unwrap(), bins);
    assert_eq!(c.replica_events_after(0, 100).await.unwrap().len(), events);
}
both!(a_batch_records_chunks_and_publishes_together);

/// A batch is all or nothing: when one publish in it cannot be written
/// (a trigger refuses it here, as a full disk or a crash would stop the
/// transaction), neither the publishes before it nor the batch's chunks
/// are recorded, and every row is as it was.
async fn a_failed_batch_records_nothing(c: Catalog) {
    let r1 = replica_at(&c, 1, "/eval/1", TransferState::Receiving).await;
    let r2 = replica_at(&c, 2, "/eval/2", TransferState::Receiving).await;
    let refuse = match c.db {
        Dialect::Sqlite => vec![format!(
            "CREATE TRIGGER refuse_r2 BEFORE UPDATE OF state ON replicas \
             WHEN NEW.id = {r2} AND NEW.state = 'published' \
             BEGIN SELECT RAISE(ABORT, 'refused by the test'); END"
        )],
        Dialect::Postgres => vec![
            "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$"
                .to_string(),
            format!(
                "CREATE TRIGGER refuse_r2 BEFORE UPDATE OF state ON replicas FOR EACH ROW \
                 WHEN (NEW.id = {r2} AND NEW.state = 'published') EXECUTE FUNCTION refuse()"
            ),
        ],
    };
    for sql in &refuse {
        sqlx::query(sql).execute(&c.pool).await.unwrap();
    }
    let published = |id: i64| PublishedReplica {
        id,
        manifest: b"m".to_vec(),
        root_hex: "ab".into(),
        local_path: format!("/eval/{id}"),
        bytes: 10,
        times: SourceTimes::default(),
        meta: CheckpointMeta::default(),
        phases: None,
    };
    let e = c
        .record_batch(
            &[vc(r1, 0, [1; 32], 4), vc(r2, 0, [2; 32], 4)],
            &[published(r1), published(r2)],
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("refused by the test"), "{e}");
    for r in [r1, r2] {
        let row = c.replica(r).await.unwrap().unwrap();
        assert_eq!(row.state, TransferState::Receiving, "{row:?}");
        assert_eq!((row.bytes_done, row.manifest_root), (0, None));
        assert!(c.chunks(r).await.unwrap().is_empty());
    }
    // Alone, the first one records, with its phases in the same
    // transaction: `publishing` grows by the time since it was measured.
    let mut phases = ferry_proto::phases::Phases::default();
    use ferry_proto::phases::Phase;
    phases.add(true, Phase::Sending, Duration::from_secs(2));
    phases.add(true, Phase::Publishing, Duration::from_millis(10));
    let measured = std::time::Instant::now()
        .checked_sub(Duration::from_millis(300))
        .unwrap();
    let mut with_phases = published(r1);
    with_phases.phases = Some((phases, measured));
    c.record_batch(&[vc(r1, 0, [1; 32], 4)], &[with_phases])
        .await
        .unwrap();
    let row = c.replica(r1).await.unwrap().unwrap();
    assert_eq!(row.state, TransferState::Published);
    let p = row.phases.expect("recorded with the publish");
    assert_eq!(p.after[&Phase::Sending], Duration::from_secs(2));
    assert!(
        p.after[&Phase::Publishing] >= Duration::from_millis(310),
        "{p:?}"
    );
    assert!(c.replica(r2).await.unwrap().unwrap().phases.is_none());
}
both!(a_failed_batch_records_nothing);

async fn signals_are_idempotent_by_key(c: Catalog) {
    let (s1, new) = c
        .insert_signal("j", "loss_spike", 0.8, Some(1200), Some("k1"))
        .await
        .unwrap();
    assert!(new);
    assert_eq!(
        (s1.job.as_str(), s1.kind.as_str(), s1.severity, s1.step),
        ("j", "loss_spike", 0.8, Some(1200))
    );
    assert_eq!(s1.idempotency_key.as_deref(), Some("k1"));
    assert_eq!(s1.transfer, None);
    // The retry returns the first signal and inserts nothing.
    let (again, new) = c
        .insert_signal("j", "nan", 0.1, None, Some("k1"))
        .await
        .unwrap();
    assert!(!new);
    assert_eq!(again, s1);
    // Without a key every signal is new.
    let (s2, new2) = c
        .insert_signal("j", "manual", 1.0, None, None)
        .await
        .unwrap();
    let (s3, new3) = c
        .insert_signal("k", "manual", 0.0, None, None)
        .await
        .unwrap();
    assert!(new2 && new3);
    assert!(s1.id < s2.id && s2.id < s3.id);

    let ids = |v: Vec<Signal>| v.into_iter().map(|s| s.id).collect::<Vec<_>>();
    assert_eq!(
        ids(c.recent_signals(10).await.unwrap()),
        [s3.id, s2.id, s1.id]
    );
    assert_eq!(ids(c.recent_signals(2).await.unwrap()), [s3.id, s2.id]);
    assert!(c.recent_signals(-1).await.unwrap().is_empty());
    assert_eq!(ids(c.signals_page(2, 1).await.unwrap()), [s2.id, s1.id]);
    assert_eq!(
        ids(c.signals_since(s1.received_at).await.unwrap()),
        [s1.id, s2.id, s3.id]
    );
    assert!(c.signals_since(now_ms() + 60_000).await.unwrap().is_empty());

    c.set_signal_transfer(s2.id, TransferId(42)).await.unwrap();
    let got = c.recent_signals(3).await.unwrap();
    assert_eq!(got[1].transfer, Some(TransferId(42)));
    assert_eq!(got[0].transfer, None);

    for (sev, what) in [
        (1.5, "severity"),
        (f64::NAN, "severity"),
        (-0.1, "severity"),
    ] {
        let e = c
            .insert_signal("j", "x", sev, None, None)
            .await
            .unwrap_err();
        assert!(
            matches!(e, CatalogError::Invalid(_)) && e.to_string().contains(what),
            "{e}"
        );
    }
    let e = c.insert_signal("", "x", 0.5, None, None).await.unwrap_err();
    assert!(e.to_string().contains("job"), "{e}");
    let e = c.insert_signal("j", "", 0.5, None, None).await.unwrap_err();
    assert!(e.to_string().contains("kind"), "{e}");
    assert_eq!(c.recent_signals(100).await.unwrap().len(), 3);
}
both!(signals_are_idempotent_by_key);

async fn api_jobs_survive_config_sync(c: Catalog) {
    c.sync_config_jobs(&[("a".into(), Some(7e10), 0.8), ("b".into(), Some(0.0), 0.2)])
        .await
        .unwrap();
    let a = c.job("a").await.unwrap().unwrap();
    assert_eq!(
        (a.model_params, a.importance, a.origin.as_str()),
        (Some(7e10), 0.8, origin::CONFIG)
    );
    // 0 parameters is an unknown size.
    assert_eq!(c.job("b").await.unwrap().unwrap().model_params, None);
    assert_eq!(c.job("zzz").await.unwrap(), None);

    let put = c.put_job("a", None, 1.0).await.unwrap();
    assert_eq!(
        (put.model_params, put.importance, put.origin.as_str()),
        (None, 1.0, origin::API)
    );
    assert_eq!(c.job("a").await.unwrap().unwrap(), put);

    // A restart with changed config: the API row keeps its values, the
    // config row follows the file, a new config job is added.
    c.sync_config_jobs(&[
        ("a".into(), Some(1e9), 0.1),
        ("b".into(), Some(1e9), 0.3),
        ("c".into(), None, 0.0),
    ])
    .await
    .unwrap();
    assert_eq!(c.job("a").await.unwrap().unwrap(), put);
    let b = c.job("b").await.unwrap().unwrap();
    assert_eq!((b.model_params, b.importance), (Some(1e9), 0.3));
    let names: Vec<String> = c
        .jobs()
        .await
        .unwrap()
        .into_iter()
        .map(|j| j.name)
        .collect();
    assert_eq!(names, ["a", "b", "c"]);

    // Setting it again through the API replaces the API values.
    let put2 = c.put_job("a", Some(3e9), 0.5).await.unwrap();
    assert_eq!((put2.model_params, put2.importance), (Some(3e9), 0.5));

    // Bad values name the job and field; nothing of the batch is written.
    let e = c
        .sync_config_jobs(&[("b".into(), None, 0.9), ("d".into(), None, 1.5)])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("\"d\" importance"), "{e}");
    assert_eq!(c.job("b").await.unwrap().unwrap().importance, 0.3);
    assert_eq!(c.job("d").await.unwrap(), None);
    let e = c
        .sync_config_jobs(&[("e".into(), Some(-1.0), 0.5)])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("\"e\" model_params"), "{e}");
    let e = c.put_job("a", Some(f64::INFINITY), 0.5).await.unwrap_err();
    assert!(e.to_string().contains("model_params"), "{e}");
    // Regression: 1e308 parameters was accepted (size term 150).
    let e = c.put_job("a", Some(1e308), 0.5).await.unwrap_err();
    assert!(
        e.to_string().contains("model_params") && e.to_string().contains("1e15"),
        "{e}"
    );
    assert!(c.put_job("z", Some(MAX_MODEL_PARAMS), 0.5).await.is_ok());
    let e = c.put_job("a", None, f64::NAN).await.unwrap_err();
    assert!(e.to_string().contains("importance"), "{e}");
    let e = c.put_job("../x", None, 0.5).await.unwrap_err();
    assert!(e.to_string().contains("job name"), "{e}");
    assert_eq!(c.job("a").await.unwrap().unwrap(), put2);
}
both!(api_jobs_survive_config_sync);

async fn class_importance_and_urgent_promotion(c: Catalog) {
    let id = c
        .insert_transfer("l", "j", "/ck/s1", "s1", Class::Scheduled)
        .await
        .unwrap();
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!((t.importance, t.urgent_until, t.signal), (None, None, None));

    c.promote_urgent(id, 1_000_000, 7).await.unwrap();
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!(t.class, Class::Scheduled);
    assert_eq!((t.urgent_until, t.signal), (Some(1_000_000), Some(7)));

    assert!(c
        .reprioritise_transfer(id, Some(Class::Background), None)
        .await
        .unwrap());
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!(t.class, Class::Background);
    assert_eq!((t.urgent_until, t.signal), (None, None));

    assert_eq!(
        c.transfer(id).await.unwrap().unwrap().class,
        Class::Background
    );
    // A class the types cannot hold (written by another version, or by
    // hand) is an error naming the column, not a silent default.
    sqlx::query(&c.db.sql("UPDATE transfers SET class = 'soon' WHERE id = ?"))
        .bind(id.as_i64())
        .execute(&c.pool)
        .await
        .unwrap();
    let e = c.transfer(id).await.unwrap_err().to_string();
    assert!(e.contains("class") && e.contains("soon"), "{e}");
    let set = |class, importance| c.reprioritise_transfer(id, class, importance);
    assert!(set(Some(Class::Background), None).await.unwrap());

    assert!(set(None, Some(Some(0.7))).await.unwrap());
    assert_eq!(c.transfer(id).await.unwrap().unwrap().importance, Some(0.7));
    let e = set(None, Some(Some(2.0))).await.unwrap_err();
    assert!(e.to_string().contains("importance"), "{e}");
    assert_eq!(c.transfer(id).await.unwrap().unwrap().importance, Some(0.7));
    // A bad importance changes nothing, not even the class given with it.
    let e = set(Some(Class::Urgent), Some(Some(f64::NAN)))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("importance"), "{e}");
    assert_eq!(
        c.transfer(id).await.unwrap().unwrap().class,
        Class::Background
    );
    let e = set(None, None).await.unwrap_err();
    assert!(e.to_string().contains("nothing to change"), "{e}");
    assert!(set(None, Some(None)).await.unwrap());
    assert_eq!(c.transfer(id).await.unwrap().unwrap().importance, None);
    // A finished transfer is not changed.
    assert!(c.cancel_transfer(id, "test").await.unwrap());
    assert!(!set(Some(Class::Urgent), Some(Some(0.1))).await.unwrap());
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!((t.class, t.importance), (Class::Background, None));
}
both!(class_importance_and_urgent_promotion);

async fn newest_unpublished_skips_final_transfers_and_keeps_paused(c: Catalog) {
    assert_eq!(c.newest_unpublished_transfer("j").await.unwrap(), None);
    let mut ids = Vec::new();
    // (created_at, state): the newest is published, the one with the
    // largest id was created earlier.
    for (n, (created, st)) in [
        (3_000, TransferState::Paused),
        (2_000, TransferState::Queued),
        (4_000, TransferState::Published),
        (5_000, TransferState::Cancelled),
        (6_000, TransferState::Failed),
    ]
    .into_iter()
    .enumerate()
    {
        let id = c
            .insert_transfer("l", "j", &format!("/ck/s{n}"), "s", Class::Scheduled)
            .await
            .unwrap();
        sqlx::query(
            &c.db
                .sql("UPDATE transfers SET created_at = ?, state = ? WHERE id = ?"),
        )
        .bind(created)
        .bind(st.as_str())
        .bind(id.as_i64())
        .execute(&c.pool)
        .await
        .unwrap();
        ids.push(id);
    }
    // Another job's newer transfer does not count.
    let other = c
        .insert_transfer("l", "k", "/ck/o", "o", Class::Scheduled)
        .await
        .unwrap();
    let t = c.newest_unpublished_transfer("j").await.unwrap().unwrap();
    assert_eq!((t.id, t.state), (ids[0], TransferState::Paused));
    assert_eq!(
        c.newest_unpublished_transfer("k")
            .await
            .unwrap()
            .unwrap()
            .id,
        other
    );
    // Paused is not final: it is resumed after a restart.
    assert!(!TransferState::Paused.is_final());
    let unfinished: Vec<TransferId> = c
        .unfinished_transfers()
        .await
        .unwrap()
        .into_iter()
        .map(|t| t.id)
        .collect();
    assert_eq!(unfinished, [ids[0], ids[1], other]);
    // Equal creation times: the larger id is the newer.
    sqlx::query(
        &c.db
            .sql("UPDATE transfers SET created_at = 3000 WHERE id = ?"),
    )
    .bind(ids[1].as_i64())
    .execute(&c.pool)
    .await
    .unwrap();
    assert_eq!(
        c.newest_unpublished_transfer("j")
            .await
            .unwrap()
            .unwrap()
            .id,
        ids[1]
    );
    // A newer background copy (logs under the job's root) is not a
    // checkpoint: the signal still promotes the checkpoint.
    let logs = c
        .insert_transfer("l", "j", "/ck/logs", "logs", Class::Background)
        .await
        .unwrap();
    let t = c.newest_unpublished_transfer("j").await.unwrap().unwrap();
    assert_ne!(t.id, logs);
    assert_eq!(t.id, ids[1]);
}
both!(newest_unpublished_skips_final_transfers_and_keeps_paused);

/// A catalog in `dir/data` made by only the migrations given (name, SQL):
/// what an older version of Ferry left. Returns the data directory and a
/// pool on it for inserting that version's rows.
async fn catalog_at_version(
    dir: &std::path::Path,
    migrations: &[(&str, &str)],
) -> (std::path::PathBuf, sqlx::SqlitePool) {
    let mdir = dir.join("old-migrations");
    std::fs::create_dir(&mdir).unwrap();
    for (name, sql) in migrations {
        std::fs::write(mdir.join(name), sql).unwrap();
    }
    let data = dir.join("data");
    std::fs::create_dir(&data).unwrap();
    let opts =
        SqliteConnectOptions::from_str(&format!("sqlite://{}", data.join("ferry.db").display()))
            .unwrap()
            .create_if_missing(true);
    let pool = SqlitePoolOptions::new().connect_with(opts).await.unwrap();
    sqlx::migrate::Migrator::new(mdir.as_path())
        .await
        .unwrap()
        .run(&pool)
        .await
        .unwrap();
    (data, pool)
}

#[tokio::test]
async fn version_2_catalog_migrates_and_keeps_its_rows() {
    let old_files = vec![FileInfo {
        path: "model/a.bin".into(),
        size: 10,
        mode: 0o644,
        mtime_ns: 7,
    }];
    let d = tempfile::tempdir().unwrap();
    let (data, pool) = catalog_at_version(
        d.path(),
        &[
            (
                "0001_catalog.sql",
                include_str!("../../../migrations/sqlite/0001_catalog.sql"),
            ),
            (
                "0002_checkpoints.sql",
                include_str!("../../../migrations/sqlite/0002_checkpoints.sql"),
            ),
        ],
    )
    .await;
    sqlx::query(
        "INSERT INTO transfers (id, link, job, source_path, rel, class, state, created_at) \
         VALUES (5, 'l', 'j', '/ck/s1', 's1', 'scheduled', 'queued', 1000)",
    )
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO replicas (id, peer, source_site, source_transfer, job, source_path, rel, \
         chunk_size, files, state, bytes_total, staging_path, local_path, created_at) \
         VALUES (9, 'p', 's', 5, 'j', '/ck/s1', 's1', 1048576, ?, 'receiving', 10, '/st', \
         '/eval/x', 1000)",
    )
    .bind(serde_json::to_string(&old_files).unwrap())
    .execute(&pool)
    .await
    .unwrap();
    sqlx::query("INSERT INTO chunks (replica, idx, hash) VALUES (9, 0, ?)")
        .bind(&[3u8; 32][..])
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;

    let c = Catalog::open(&data).await.unwrap();
    // 0004 moved the file table out of the row.
    assert_eq!(c.replica_files(9).await.unwrap(), old_files);
    let t = c.transfer(TransferId(5)).await.unwrap().unwrap();
    assert_eq!((t.class, t.created_at), (Class::Scheduled, 1000));
    assert_eq!((t.importance, t.urgent_until, t.signal), (None, None, None));
    assert_eq!(c.chunks(9).await.unwrap(), vec![(0, [3; 32])]);
    let old: (Option<i64>, Option<i64>) = sqlx::query_as(
        &c.db
            .sql("SELECT verified_at, bytes FROM chunks WHERE replica = 9"),
    )
    .fetch_one(&c.pool)
    .await
    .unwrap();
    assert_eq!(old, (None, None));
    assert!(c.jobs().await.unwrap().is_empty());
    c.put_job("j", Some(7e9), 0.5).await.unwrap();
    let (s, _) = c.insert_signal("j", "nan", 1.0, None, None).await.unwrap();
    c.promote_urgent(TransferId(5), 2_000, s.id).await.unwrap();
    assert_eq!(
        c.newest_unpublished_transfer("j")
            .await
            .unwrap()
            .unwrap()
            .signal,
        Some(s.id)
    );
    let v: i64 = sqlx::query_scalar(&c.db.sql("SELECT MAX(version) FROM _sqlx_migrations"))
        .fetch_one(&c.pool)
        .await
        .unwrap();
    assert_eq!(v, crate::schema_version());
    // 0006: an older replica has no step, class, pin or removal.
    let r = c.replica(9).await.unwrap().unwrap();
    assert_eq!(
        (r.step, r.class, r.pin, r.removal),
        (None, None, None, None)
    );
    // 0005 gave the older transfer, job and signal their events.
    let kinds: Vec<(i64, EventKind)> = c
        .events_since(0)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.at_ms, e.change.kind()))
        .collect();
    assert_eq!(kinds[0], (1000, EventKind::Arrival));
    c.close().await;
    drop(c);
    // Opening again applies nothing new and keeps the rows.
    let c = Catalog::open(&data).await.unwrap();
    assert_eq!(c.job("j").await.unwrap().unwrap().importance, 0.5);
}

#[tokio::test]
async fn sqlite_catalog_runs_in_wal_mode_with_foreign_keys() {
    let d = tempfile::tempdir().unwrap();
    let c = Catalog::open(d.path()).await.unwrap();
    // Every pooled connection gets the pragmas, not just the first.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(c.pool.acquire().await.unwrap());
    }
    for conn in &mut held {
        let mode: String = sqlx::query_scalar(&c.db.sql("PRAGMA journal_mode"))
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        assert_eq!(mode, "wal");
        let fk: i64 = sqlx::query_scalar(&c.db.sql("PRAGMA foreign_keys"))
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        assert_eq!(fk, 1);
        let sync: i64 = sqlx::query_scalar(&c.db.sql("PRAGMA synchronous"))
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        assert_eq!(sync, 1, "NORMAL");
    }
}

#[tokio::test]
async fn a_file_that_is_not_a_catalog_is_refused_naming_it() {
    let d = tempfile::tempdir().unwrap();
    let c = Catalog::open(d.path()).await.unwrap();
    // Everything in the main file, as after an agent's clean stop.
    sqlx::query(&c.db.sql("PRAGMA wal_checkpoint(TRUNCATE)"))
        .execute(&c.pool)
        .await
        .unwrap();
    c.close().await;
    drop(c);
    let db = d.path().join("ferry.db");
    let mut bytes = std::fs::read(&db).unwrap();
    bytes[..100].fill(0xa5);
    std::fs::write(&db, &bytes).unwrap();
    // Refused at once (the pool alone would retry the connection until its
    // acquire timeout), naming the file, which stays as it was.
    let e = tokio::time::timeout(std::time::Duration::from_secs(20), Catalog::open(d.path()))
        .await
        .expect("refused without retrying")
        .unwrap_err()
        .to_string();
    assert!(e.contains(&db.display().to_string()), "{e}");
    assert_eq!(std::fs::read(&db).unwrap(), bytes);
}

/// One database per site: the first agent records its site, an agent of
/// another site is refused naming both, and the first may come back.
#[tokio::test]
async fn postgres_catalog_of_another_site_is_refused_naming_both() {
    let (admin, name, url) = fresh_pg_database().await;
    let a = Catalog::open_postgres(&url, "train-a").await.unwrap();
    assert_eq!(a.site().await.unwrap().as_deref(), Some("train-a"));
    let e = Catalog::open_postgres(&url, "train-b").await.unwrap_err();
    let shown = e.to_string();
    assert!(matches!(e, CatalogError::OtherSite { .. }), "{shown}");
    assert!(
        shown.contains("'train-a'") && shown.contains("'train-b'"),
        "{shown}"
    );
    // A second agent of the same site shares it.
    let a2 = Catalog::open_postgres(&url, "train-a").await.unwrap();
    let id = a
        .insert_transfer("l", "j", "/ck/1", "1", Class::Scheduled)
        .await
        .unwrap();
    assert!(a2.transfer(id).await.unwrap().is_some());
    a.close().await;
    a2.close().await;
    drop_pg_database(&admin, &name).await;
}

/// A login with a password (from a password file, as the config gives
/// it) opens the catalog; a wrong password is refused, and neither
/// password appears in the error.
#[tokio::test]
async fn postgres_password_comes_from_a_file_and_never_shows_in_errors() {
    use sqlx::Connection;
    let (admin, name, url) = fresh_pg_database().await;
    let role = format!("{name}_role");
    let password = format!("pw-{}-s3cr3t", now_ms());
    let mut conn = sqlx::PgConnection::connect(admin.secret()).await.unwrap();
    // ops/with-test-pg makes members of ferry_password_login log in with
    // a password (scram-sha-256); everyone else is trusted.
    for sql in [
        "DO $$ BEGIN CREATE ROLE ferry_password_login NOLOGIN; \
         EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
            .to_string(),
        format!("CREATE ROLE {role} LOGIN PASSWORD '{password}' IN ROLE ferry_password_login"),
        format!("ALTER DATABASE {name} OWNER TO {role}"),
    ] {
        sqlx::query(&sql).execute(&mut conn).await.unwrap();
    }
    let base = url.with_user(&role);
    let d = tempfile::tempdir().unwrap();
    let file = d.path().join("catalog.password");
    std::fs::write(&file, format!("{password}\n")).unwrap();
    let good = base.clone().with_password_file(&file).unwrap();
    assert!(!good.to_string().contains(&password), "{good}");
    let c = Catalog::open_postgres(&good, "s").await.unwrap();
    assert!(!format!("{c:?}").contains(&password), "{c:?}");
    // Its connections name themselves in pg_stat_activity.
    let app: String = sqlx::query_scalar(
        "SELECT application_name::text FROM pg_stat_activity WHERE pid = pg_backend_pid()",
    )
    .fetch_one(&c.pool)
    .await
    .unwrap();
    assert_eq!(app, "ferry");
    // Its LISTEN connection too.
    let listener = c
        .listen_pool(std::time::Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    let apps: Vec<String> = sqlx::query_scalar(
        "SELECT application_name::text FROM pg_stat_activity \
         WHERE datname = current_database() AND query LIKE 'LISTEN%'",
    )
    .fetch_all(&c.pool)
    .await
    .unwrap();
    assert_eq!(apps, vec!["ferry".to_string()]);
    drop(listener);
    c.close().await;

    let wrong = format!("{password}-wrong");
    let bad = base.clone().with_password(&wrong).unwrap();
    let e = Catalog::open_postgres(&bad, "s").await.unwrap_err();
    let shown = format!("{e} {e:?}");
    assert!(shown.contains("password authentication failed"), "{shown}");
    assert!(
        shown.contains(":***@"),
        "the URL is shown redacted: {shown}"
    );
    assert!(
        !shown.contains(&password) && !shown.contains("s3cr3t"),
        "{shown}"
    );

    // A wrong password from a file: the refusal names the file.
    let wrong_file = d.path().join("wrong.password");
    std::fs::write(&wrong_file, format!("{wrong}\n")).unwrap();
    let bad = base.clone().with_password_file(&wrong_file).unwrap();
    let e = Catalog::open_postgres(&bad, "s").await.unwrap_err();
    let shown = e.to_string();
    assert!(
        shown.contains("password authentication failed")
            && shown.contains(&format!("password_file {}", wrong_file.display()))
            && !shown.contains(&password),
        "{shown}"
    );

    // A missing or empty file is named, and its content never shown.
    let e = base
        .clone()
        .with_password_file(&d.path().join("nope"))
        .unwrap_err();
    assert!(e.contains("nope"), "{e}");
    std::fs::write(&file, "\n").unwrap();
    let e = base.clone().with_password_file(&file).unwrap_err();
    assert!(e.contains("is empty"), "{e}");
    let e = good.with_password_file(&file).unwrap_err();
    assert!(e.contains("keep one") && !e.contains(&password), "{e}");

    drop_pg_database(&admin, &name).await;
    sqlx::query(&format!("DROP ROLE {role}"))
        .execute(&mut conn)
        .await
        .unwrap();
    conn.close().await.unwrap();
}

/// A server that cannot be reached is reported with the URL, its password
/// replaced; no server needed.
#[tokio::test]
async fn an_unreachable_postgres_catalog_is_reported_without_its_password() {
    // Port 1 on loopback: nothing listens there.
    let url = PostgresUrl::parse("postgres://ferry:Hunter2-secret@127.0.0.1:1/site_a").unwrap();
    let e = Catalog::open_postgres(&url, "s").await.unwrap_err();
    // Nothing answered: an agent at start waits for such a server.
    assert!(matches!(e, CatalogError::Unreachable { .. }), "{e:?}");
    let shown = format!("{e} {e:?}");
    assert!(
        shown.contains("postgres://ferry:***@127.0.0.1:1/site_a"),
        "{shown}"
    );
    assert!(shown.contains("cannot connect"), "{shown}");
    assert!(!shown.contains("Hunter2"), "{shown}");
}

/// Everything a catalog shows through its API, for comparing two.
async fn snapshot(c: &Catalog, replicas: &[i64]) -> Vec<String> {
    let mut v = vec![
        format!("{:?}", c.transfers(1000, 0).await.unwrap()),
        format!("{:?}", c.replicas(false, 1000, 0).await.unwrap()),
        format!("{:?}", c.jobs().await.unwrap()),
        format!("{:?}", c.recent_signals(1000).await.unwrap()),
        format!("{:?}", c.events_since(i64::MIN).await.unwrap()),
    ];
    for r in replicas {
        v.push(format!("{:?}", c.chunks(*r).await.unwrap()));
        v.push(format!("{:?}", c.chunk_arrivals(*r).await.unwrap()));
        v.push(format!("{:?}", c.replica_files(*r).await.unwrap()));
    }
    v
}

/// `ferry catalog migrate`: a single agent's SQLite catalog (transfers,
/// jobs, signals, events, replicas with their files, chunks and
/// publishes) lands in an empty PostgreSQL catalog as it was, with its
/// ids; new rows there continue after them; a target that holds
/// transfers is refused and left as it was.
#[tokio::test]
async fn an_sqlite_catalog_copies_into_an_empty_postgres_catalog() {
    let d = tempfile::tempdir().unwrap();
    let src = Catalog::open(d.path()).await.unwrap();
    let t1 = src
        .insert_transfer("l", "j", "/ck/1", "1", Class::Scheduled)
        .await
        .unwrap();
    src.insert_transfer("l", "k", "/ck/2", "2", Class::Background)
        .await
        .unwrap();
    src.reprioritise_transfer(t1, Some(Class::Urgent), Some(Some(0.25)))
        .await
        .unwrap();
    src.note_transfer_progress(
        t1,
        ProgressNote {
            bytes_total: 100,
            bytes_done: 40,
            bytes_sent: 50,
        },
    )
    .await
    .unwrap();
    src.put_job("j", Some(7e9), 0.5).await.unwrap();
    src.put_job("k", None, 0.0).await.unwrap();
    src.insert_signal("j", "nan", 0.75, Some(12), Some("key-1"))
        .await
        .unwrap();
    src.record_link_rate("l", 1_000_000).await.unwrap();
    let files = vec![FileInfo {
        path: "a.bin".into(),
        size: 8,
        mtime_ns: 5,
        mode: 0o644,
    }];
    let r1 = replica_at(&src, 1, "/eval/1", TransferState::Receiving).await;
    let r2 = replica_at(&src, 2, "/eval/2", TransferState::Receiving).await;
    src.set_replica_files(r1, &files, 10).await.unwrap();
    src.record_batch(
        &[
            VerifiedChunk {
                arrived_ms: Some(now_ms() - 2_000),
                arrival_started_ms: Some(now_ms() - 2_500),
                ..vc(r1, 0, [1; 32], 4)
            },
            vc(r2, 0, [2; 32], 5),
        ],
        &[PublishedReplica {
            id: r1,
            manifest: b"manifest".to_vec(),
            root_hex: "aa".into(),
            local_path: "/eval/1".into(),
            bytes: 10,
            times: SourceTimes {
                committed_ms: now_ms() - 3_000,
                opened_ms: 0,
            },
            meta: CheckpointMeta {
                step: Some(7),
                class: Some(Class::Background),
                readers: None,
            },
            phases: None,
        }],
    )
    .await
    .unwrap();
    let before = snapshot(&src, &[r1, r2]).await;

    let (admin, name, url) = fresh_pg_database().await;
    let dst = Catalog::open_postgres(&url, "s").await.unwrap();
    let counts = src.copy_into(&dst).await.unwrap();
    let count = |t: &str| counts.iter().find(|c| c.0 == t).unwrap().1;
    assert_eq!(
        (count("transfers"), count("replicas")),
        (2, 2),
        "{counts:?}"
    );
    assert_eq!(
        count("chunks"),
        1,
        "r1's chunks went at publish: {counts:?}"
    );
    assert_eq!(snapshot(&dst, &[r1, r2]).await, before);
    assert_eq!(
        dst.replica_manifest(r1).await.unwrap().as_deref(),
        Some(&b"manifest"[..])
    );
    let t3 = dst
        .insert_transfer("l", "j", "/ck/3", "3", Class::Scheduled)
        .await
        .unwrap();
    assert!(
        t3.as_i64() > 2,
        "ids continue after the copied ones: {t3:?}"
    );
    // The catalog's id moves with it (the sinks key its transfers by it).
    assert_ne!(src.id(), dst.id());
    let moved = Catalog::open_postgres(&url, "s").await.unwrap();
    assert_eq!(moved.id(), src.id());
    assert_eq!(moved.id().len(), 32);
    moved.close().await;

    let e = src.copy_into(&dst).await.unwrap_err();
    assert!(e.to_string().contains("already holds 3 transfers"), "{e}");
    assert_eq!(dst.transfers(1000, 0).await.unwrap().len(), 3);
    dst.close().await;
    drop_pg_database(&admin, &name).await;
}

both!(hot_file_hints_are_kept_until_they_end);

/// A replica's replication hint reads back, is listed once it has ended
/// (not before), and is gone once cleared.
async fn hot_file_hints_are_kept_until_they_end(c: Catalog) {
    let t = c
        .insert_pushed_transfer("l", "j", "/ck/h1", "h1", Class::Scheduled, None)
        .await
        .unwrap();
    let a = replica_for(&c, t.id).await;
    assert_eq!(c.replica(a).await.unwrap().unwrap().hot, None);
    c.set_replica_hot(a, 64, 3, 5_000).await.unwrap();
    let hot = c.replica(a).await.unwrap().unwrap().hot;
    assert_eq!(
        hot,
        Some(crate::HotHint {
            factor: 64,
            previous: 3,
            until: 5_000
        })
    );
    assert!(c.replicas_hot_ended(4_999).await.unwrap().is_empty());
    let ended = c.replicas_hot_ended(5_000).await.unwrap();
    assert_eq!(ended.iter().map(|r| r.id).collect::<Vec<_>>(), [a]);
    c.clear_replica_hot(a).await.unwrap();
    assert_eq!(c.replica(a).await.unwrap().unwrap().hot, None);
    assert!(c.replicas_hot_ended(i64::MAX).await.unwrap().is_empty());
}

async fn deadlines_absolute_after_commit_and_said_once(c: Catalog) {
    use crate::DeadlineState;
    let id = c
        .insert_transfer("l", "j", "/ck/s1", "s1", Class::Scheduled)
        .await
        .unwrap();
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!((t.deadline_ms(), t.deadline_state), (None, None));
    // Nothing to say about a transfer without a deadline.
    assert!(!c.note_deadline(id, DeadlineState::AtRisk).await.unwrap());

    c.set_transfer_deadline(id, Some(5_000), None)
        .await
        .unwrap();
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!(t.deadline_ms(), Some(5_000));
    // At risk once, then missed once; nothing moves back.
    assert!(c.note_deadline(id, DeadlineState::AtRisk).await.unwrap());
    assert!(!c.note_deadline(id, DeadlineState::AtRisk).await.unwrap());
    assert!(c.note_deadline(id, DeadlineState::Missed).await.unwrap());
    assert!(!c.note_deadline(id, DeadlineState::Met).await.unwrap());
    assert!(!c.note_deadline(id, DeadlineState::AtRisk).await.unwrap());
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!(t.deadline_state, Some(DeadlineState::Missed));

    // A duration after commit: no time until the commit is seen.
    let id2 = c
        .insert_transfer("l", "j", "/ck/s2", "s2", Class::Scheduled)
        .await
        .unwrap();
    c.set_transfer_deadline(id2, None, Some(60_000))
        .await
        .unwrap();
    let t = c.transfer(id2).await.unwrap().unwrap();
    assert_eq!((t.deadline_at, t.deadline_ms()), (None, None));
    assert!(!c.note_deadline(id2, DeadlineState::AtRisk).await.unwrap());
    c.set_checkpoint_state(
        id2,
        ferry_proto::state::CheckpointState::Committed,
        Some(1_000),
        Some("m"),
    )
    .await
    .unwrap();
    let t = c.transfer(id2).await.unwrap().unwrap();
    assert_eq!(
        (t.deadline_at, t.deadline_ms()),
        (Some(61_000), Some(61_000))
    );
    assert!(c.note_deadline(id2, DeadlineState::Met).await.unwrap());
    // Given again after the commit: the time follows from the commit at
    // once, and what was said is forgotten.
    c.set_transfer_deadline(id2, None, Some(2_000))
        .await
        .unwrap();
    let t = c.transfer(id2).await.unwrap().unwrap();
    assert_eq!((t.deadline_at, t.deadline_state), (Some(3_000), None));
}
both!(deadlines_absolute_after_commit_and_said_once);

/// Publish events: a publish, the version a re-save replaces, a removal,
/// in order, each once; read after an id; pruned after 7 days.
async fn publish_events_are_logged_in_order(c: Catalog) {
    assert_eq!(c.last_replica_event().await.unwrap(), 0);
    let a = published_at(&c, 1, "/eval/a").await;
    let other = published_at(&c, 2, "/eval/b").await;
    let a2 = published_at(&c, 3, "/eval/a").await;
    assert!(c
        .begin_replica_removal(a, RemovalReason::Operator, "test", false, 10)
        .await
        .unwrap());
    assert!(c.finish_replica_removal(a).await.unwrap());
    // Finishing again says nothing more.
    assert!(!c.finish_replica_removal(a).await.unwrap());
    let ev = c.replica_events_after(0, 100).await.unwrap();
    let got: Vec<(&str, i64, Option<i64>)> = ev
        .iter()
        .map(|e| (e.kind.as_str(), e.replica, e.replaced_by))
        .collect();
    assert_eq!(
        got,
        vec![
            ("published", a, None),
            ("published", other, None),
            ("published", a2, None),
            ("replaced", a, Some(a2)),
            ("removed", a, None),
        ]
    );
    assert!(ev.windows(2).all(|w| w[0].id < w[1].id));
    assert_eq!(ev[0].location, "/eval/a");
    assert_eq!((ev[0].job.as_str(), ev[0].profile.as_str()), ("j", "full"));
    assert_eq!(c.last_replica_event().await.unwrap(), ev[4].id);
    let after = c.replica_events_after(ev[2].id, 100).await.unwrap();
    assert_eq!(after.len(), 2);
    assert_eq!(
        c.replica_events_after(ev[1].id, 1).await.unwrap()[0].id,
        ev[2].id
    );
    // Nothing is a week old yet.
    assert_eq!(c.prune_replica_events().await.unwrap(), 0);
    // Webhook positions.
    assert_eq!(c.webhook_position("http://h/x").await.unwrap(), None);
    c.set_webhook_position("http://h/x", 3).await.unwrap();
    c.set_webhook_position("http://h/x", 5).await.unwrap();
    assert_eq!(c.webhook_position("http://h/x").await.unwrap(), Some(5));
}
both!(publish_events_are_logged_in_order);
