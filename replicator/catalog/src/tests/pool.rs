//! The pool: heartbeats, agent states and transfer leases, on both
//! dialects; concurrent claims on PostgreSQL.

use super::*;

fn beat<'a>(name: &'a str, timeout_ms: i64) -> Heartbeat<'a> {
    Heartbeat {
        name,
        role: "source",
        version: "0.1.0",
        api_url: "http://127.0.0.1:1",
        timeout_ms,
        instance: "p1",
        sent_bps: 8e6,
        received_bps: 0.0,
    }
}

async fn queued(c: &Catalog) -> TransferId {
    c.insert_pushed_transfer("l", "j", "/src/a", "a", Class::Scheduled, Some((100, 1)))
        .await
        .unwrap()
        .id
}

/// Waits (bounded) until the database clock passes `until_ms`.
async fn wait_past(c: &Catalog, until_ms: i64) {
    for _ in 0..200 {
        if c.db_now_ms().await.unwrap() > until_ms {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("the database clock did not pass {until_ms}");
}

async fn one_agent_holds_a_transfer_until_it_releases_it(c: Catalog) {
    let id = queued(&c).await;
    for a in ["a", "b"] {
        c.register_agent(&beat(a, 60_000)).await.unwrap();
    }
    let first = c.claim_transfer(id, "a", 60_000).await.unwrap().unwrap();
    assert_eq!(first.epoch, 1);
    assert_eq!(first.took_over_from, None);
    assert_eq!(c.claim_transfer(id, "b", 60_000).await.unwrap(), None);
    // The holder renews, under the same epoch.
    let again = c.claim_transfer(id, "a", 60_000).await.unwrap().unwrap();
    assert_eq!(again.epoch, 1);
    assert_eq!(
        c.transfer(id).await.unwrap().unwrap().holder.as_deref(),
        Some("a")
    );
    let agents = c.pool_agents().await.unwrap();
    let a = agents.iter().find(|x| x.name == "a").unwrap();
    assert_eq!(
        (a.state, a.held, a.held_bytes_left),
        (AgentState::Live, 1, 100)
    );
    assert_eq!(agents.iter().find(|x| x.name == "b").unwrap().held, 0);
    // Another agent cannot release it.
    assert!(!c.release_transfer(id, "b", 1).await.unwrap());
    assert!(c.release_transfer(id, "a", 1).await.unwrap());
    assert_eq!(c.transfer(id).await.unwrap().unwrap().holder, None);
    let second = c.claim_transfer(id, "b", 60_000).await.unwrap().unwrap();
    assert_eq!((second.epoch, second.took_over_from), (2, None));
    let leases = c.transfer_leases(id).await.unwrap();
    assert_eq!(leases.len(), 2);
    assert_eq!(leases[0].agent, "a");
    assert_eq!(leases[0].end_reason.as_deref(), Some("released"));
    assert!(leases[0].ended_at.unwrap() <= leases[1].claimed_at);
    assert_eq!((leases[1].agent.as_str(), leases[1].ended_at), ("b", None));
}
both!(one_agent_holds_a_transfer_until_it_releases_it);

async fn a_lease_not_renewed_lapses_and_another_agent_takes_over(c: Catalog) {
    let id = queued(&c).await;
    c.register_agent(&beat("a", 300)).await.unwrap();
    c.register_agent(&beat("b", 60_000)).await.unwrap();
    let a = c.claim_transfer(id, "a", 300).await.unwrap().unwrap();
    wait_past(&c, a.lease_until).await;
    // Lapsed: nobody holds it, a's heartbeat no longer renews it, and a
    // is down.
    assert_eq!(c.transfer(id).await.unwrap().unwrap().holder, None);
    let b_state =
        |agents: Vec<PoolAgent>, n: &str| agents.into_iter().find(|x| x.name == n).unwrap().state;
    assert_eq!(
        b_state(c.pool_agents().await.unwrap(), "a"),
        AgentState::Down
    );
    let taken = c.claim_transfer(id, "b", 60_000).await.unwrap().unwrap();
    assert_eq!(taken.epoch, 2);
    assert_eq!(taken.took_over_from.as_deref(), Some("a"));
    let renewed = c.heartbeat(&beat("a", 300)).await.unwrap();
    assert!(renewed.held.is_empty(), "{renewed:?}");
    assert_eq!(
        b_state(c.pool_agents().await.unwrap(), "a"),
        AgentState::Live
    );
    // b's heartbeat renews b's lease.
    let b = c.heartbeat(&beat("b", 60_000)).await.unwrap();
    assert_eq!(b.held, vec![id]);
    let leases = c.transfer_leases(id).await.unwrap();
    assert_eq!(leases[0].end_reason.as_deref(), Some("lapsed"));
    assert_eq!(leases[0].ended_at, Some(a.lease_until));
    assert!(leases[0].ended_at.unwrap() < leases[1].claimed_at);
}
both!(a_lease_not_renewed_lapses_and_another_agent_takes_over);

async fn paused_and_finished_transfers_are_not_claimed(c: Catalog) {
    let id = queued(&c).await;
    c.register_agent(&beat("a", 60_000)).await.unwrap();
    assert!(c.pause_transfer(id).await.unwrap());
    assert_eq!(c.claim_transfer(id, "a", 60_000).await.unwrap(), None);
    assert!(c.resume_transfer(id).await.unwrap());
    assert!(c.claim_transfer(id, "a", 60_000).await.unwrap().is_some());
    assert!(c.cancel_transfer(id, "test").await.unwrap());
    assert_eq!(c.claim_transfer(id, "a", 60_000).await.unwrap(), None);
    // An unknown agent's heartbeat is an error naming it.
    let e = c.heartbeat(&beat("ghost", 1000)).await.unwrap_err();
    assert!(e.to_string().contains("ghost"), "{e}");
}
both!(paused_and_finished_transfers_are_not_claimed);

async fn a_clean_stop_releases_everything_and_drain_is_recorded(c: Catalog) {
    let (x, y) = (queued(&c).await, queued(&c).await);
    c.register_agent(&beat("a", 60_000)).await.unwrap();
    c.claim_transfer(x, "a", 60_000).await.unwrap().unwrap();
    c.claim_transfer(y, "a", 60_000).await.unwrap().unwrap();
    assert!(c.set_agent_draining("a", true).await.unwrap());
    assert!(!c.set_agent_draining("nobody", true).await.unwrap());
    let b = c.heartbeat(&beat("a", 60_000)).await.unwrap();
    assert!(b.draining);
    assert_eq!(b.held, vec![x, y]);
    let a = |agents: Vec<PoolAgent>| agents.into_iter().find(|x| x.name == "a").unwrap();
    assert_eq!(
        a(c.pool_agents().await.unwrap()).state,
        AgentState::Draining
    );
    c.agent_stopped("a", "p1").await.unwrap();
    let stopped = a(c.pool_agents().await.unwrap());
    assert_eq!((stopped.state, stopped.held), (AgentState::Stopped, 0));
    for id in [x, y] {
        let l = c.transfer_leases(id).await.unwrap();
        assert_eq!(l[0].end_reason.as_deref(), Some("released"), "{l:?}");
    }
    // Registering again keeps the operator's drain.
    c.register_agent(&beat("a", 60_000)).await.unwrap();
    assert!(c.heartbeat(&beat("a", 60_000)).await.unwrap().draining);
}
both!(a_clean_stop_releases_everything_and_drain_is_recorded);

/// Many agents claim one transfer at once on PostgreSQL: exactly one
/// gets it.
#[tokio::test]
async fn concurrent_claims_on_postgres_give_one_lease() {
    let t = TestCatalog::new(Dialect::Postgres).await;
    let c = t.catalog.clone();
    let id = queued(&c).await;
    let names: Vec<String> = (0..8).map(|i| format!("agent-{i}")).collect();
    for n in &names {
        c.register_agent(&beat(n, 60_000)).await.unwrap();
    }
    let claims = futures::future::join_all(names.iter().map(|n| {
        let c = c.clone();
        async move { c.claim_transfer(id, n, 60_000).await.unwrap() }
    }))
    .await;
    assert_eq!(
        claims.iter().filter(|c| c.is_some()).count(),
        1,
        "{claims:?}"
    );
    assert_eq!(c.transfer_leases(id).await.unwrap().len(), 1);
    t.finish().await;
}

/// An agent cut off in the middle of a transaction (here: a transaction
/// left open, holding the row lock of a watch, as behind a silent route)
/// does not block the others for long: the server ends the idle session
/// after `IDLE_IN_TRANSACTION_TIMEOUT_MS`, and another agent's claim of
/// that watch goes through.
#[tokio::test]
async fn a_transaction_left_open_releases_its_locks_after_the_idle_timeout() {
    let t = TestCatalog::new(Dialect::Postgres).await;
    let c = t.catalog.clone();
    c.register_agent(&beat("b", 60_000)).await.unwrap();
    c.claim_watch("/ckpt", "b", 1).await.unwrap().unwrap();
    let mut stuck = c.pool.begin().await.unwrap();
    sqlx::query(
        &c.db
            .sql("UPDATE watches SET lease_until = 0 WHERE root = ?"),
    )
    .bind("/ckpt")
    .execute(&mut *stuck)
    .await
    .unwrap();
    let started = std::time::Instant::now();
    let claim = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        c.claim_watch("/ckpt", "b", 60_000),
    )
    .await
    .expect("the claim waited on a lock held by an idle transaction for 30 s");
    assert!(claim.unwrap().is_some());
    let waited = started.elapsed();
    assert!(
        waited
            >= std::time::Duration::from_millis(crate::dialect::IDLE_IN_TRANSACTION_TIMEOUT_MS / 2),
        "the open transaction should have held the lock a while: {waited:?}"
    );
    // The server ended the idle session: its transaction cannot commit.
    assert!(stuck.commit().await.is_err());
    t.finish().await;
}

/// A catalog's id is made once and kept across opens; two catalogs
/// never share one.
#[tokio::test]
async fn a_catalog_keeps_its_id_and_two_catalogs_differ() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a = Catalog::open(d1.path()).await.unwrap();
    let id = a.id().to_string();
    assert_eq!(id.len(), 32, "{id}");
    a.close().await;
    drop(a);
    let again = Catalog::open(d1.path()).await.unwrap();
    assert_eq!(again.id(), id);
    assert_eq!(Catalog::open_read_only(d1.path()).await.unwrap().id(), id);
    let b = Catalog::open(d2.path()).await.unwrap();
    assert_ne!(b.id(), id);
}

/// An agent refuses a catalog an agent of a newer release migrated,
/// naming both schema versions, and changes nothing in it.
#[tokio::test]
async fn a_catalog_of_a_newer_schema_is_refused_naming_both_versions() {
    let add_future = |db: Dialect| {
        db.sql(
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (?, 'from the future', TRUE, ?, 0)",
        )
        .into_owned()
    };
    let known = crate::schema_version();
    let future = known + 90;
    // SQLite.
    let d = tempfile::tempdir().unwrap();
    let c = Catalog::open(d.path()).await.unwrap();
    sqlx::query(&add_future(Dialect::Sqlite))
        .bind(future)
        .bind(vec![0u8; 48])
        .execute(&c.pool)
        .await
        .unwrap();
    c.close().await;
    drop(c);
    let e = Catalog::open(d.path()).await.unwrap_err().to_string();
    assert!(
        e.contains(&format!(
            "schema is version {future}, newer than this agent's {known}"
        )),
        "{e}"
    );
    // PostgreSQL.
    let (admin, name, url) = fresh_pg_database().await;
    let c = Catalog::open_postgres(&url, TestCatalog::SITE)
        .await
        .unwrap();
    sqlx::query(&add_future(Dialect::Postgres))
        .bind(future)
        .bind(vec![0u8; 48])
        .execute(&c.pool)
        .await
        .unwrap();
    c.close().await;
    let e = Catalog::open_postgres(&url, TestCatalog::SITE)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "schema is version {future}, newer than this agent's {known}"
        )),
        "{e}"
    );
    drop_pg_database(&admin, &name).await;
}

async fn one_name_runs_once_and_a_drained_agent_claims_nothing(c: Catalog) {
    let id = queued(&c).await;
    c.register_agent(&beat("a", 60_000)).await.unwrap();
    if c.dialect() == Dialect::Sqlite {
        // One agent per SQLite catalog (the data directory's lock): a new
        // process is the agent restarted, and takes the row at once.
        let restarted = Heartbeat {
            instance: "p9",
            ..beat("a", 60_000)
        };
        c.register_agent(&restarted).await.unwrap();
        assert!(c.heartbeat(&restarted).await.is_ok());
        assert!(matches!(
            c.heartbeat(&beat("a", 60_000)).await,
            Err(CatalogError::AgentName(_))
        ));
        return;
    }
    // Another process under the same name is refused while a is live,
    // naming it; its heartbeats are refused too.
    let twin = Heartbeat {
        instance: "p2",
        api_url: "http://127.0.0.1:2",
        ..beat("a", 60_000)
    };
    match c.register_agent(&twin).await {
        Err(CatalogError::AgentName(why)) => {
            assert!(
                why.contains("agent a is live") && why.contains("127.0.0.1:1"),
                "{why}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        c.heartbeat(&twin).await,
        Err(CatalogError::AgentName(_))
    ));
    // ... and a stop by the twin changes nothing.
    c.agent_stopped("a", "p2").await.unwrap();
    assert!(c.heartbeat(&beat("a", 60_000)).await.is_ok());
    // Drained, a claims nothing at once (before any heartbeat).
    assert!(c.set_agent_draining("a", true).await.unwrap());
    assert_eq!(c.claim_transfer(id, "a", 60_000).await.unwrap(), None);
    assert!(c.set_agent_draining("a", false).await.unwrap());
    assert!(c.claim_transfer(id, "a", 60_000).await.unwrap().is_some());
    // Once a stopped, the name is free for the twin.
    c.agent_stopped("a", "p1").await.unwrap();
    c.register_agent(&twin).await.unwrap();
    assert!(c.heartbeat(&twin).await.is_ok());
    assert!(matches!(
        c.heartbeat(&beat("a", 60_000)).await,
        Err(CatalogError::AgentName(_))
    ));
}
both!(one_name_runs_once_and_a_drained_agent_claims_nothing);

async fn one_agent_watches_a_root_and_another_takes_the_watch_over(c: Catalog) {
    c.register_agent(&beat("a", 300)).await.unwrap();
    c.register_agent(&beat("b", 60_000)).await.unwrap();
    let first = c.claim_watch("/ckpt", "a", 300).await.unwrap().unwrap();
    assert_eq!((first.epoch, first.took_over_from), (1, None));
    // Renewing keeps the epoch; another agent cannot take a live watch.
    assert_eq!(
        c.claim_watch("/ckpt", "a", 300)
            .await
            .unwrap()
            .unwrap()
            .epoch,
        1
    );
    assert_eq!(c.claim_watch("/ckpt", "b", 60_000).await.unwrap(), None);
    // Another root is independent.
    assert!(c
        .claim_watch("/other", "b", 60_000)
        .await
        .unwrap()
        .is_some());
    let a = c.pool_agents().await.unwrap();
    assert_eq!(a.iter().find(|x| x.name == "a").unwrap().watches, 1);
    let w = c.watches().await.unwrap();
    assert_eq!(w.len(), 2);
    assert_eq!(c.watch("/ckpt").await.unwrap().as_ref(), Some(&w[0]));
    assert_eq!(c.watch("/never").await.unwrap(), None);
    assert_eq!(
        (w[0].root.as_str(), w[0].holder.as_deref(), w[0].live),
        ("/ckpt", Some("a"), true)
    );
    // a stops heartbeating: its lease lapses, is not renewed, and b takes
    // the watch over under the next epoch.
    let until = w[0].lease_until.unwrap();
    wait_past(&c, until).await;
    assert!(!c.watches().await.unwrap()[0].live);
    let taken = c.claim_watch("/ckpt", "b", 60_000).await.unwrap().unwrap();
    assert_eq!(
        (taken.epoch, taken.took_over_from.as_deref()),
        (2, Some("a"))
    );
    let late = c.heartbeat(&beat("a", 300)).await.unwrap();
    assert!(late.watches.is_empty(), "{late:?}");
    let b = c.heartbeat(&beat("b", 60_000)).await.unwrap();
    assert_eq!(b.watches, vec!["/ckpt".to_string(), "/other".to_string()]);
    // Released: nobody holds it; a drained agent claims nothing; a clean
    // stop releases every watch.
    assert!(!c.release_watch("/ckpt", "a").await.unwrap());
    assert!(c.release_watch("/ckpt", "b").await.unwrap());
    assert_eq!(c.watches().await.unwrap()[0].holder, None);
    assert!(c.set_agent_draining("a", true).await.unwrap());
    assert_eq!(c.claim_watch("/ckpt", "a", 60_000).await.unwrap(), None);
    c.agent_stopped("b", "p1").await.unwrap();
    assert!(c
        .watches()
        .await
        .unwrap()
        .iter()
        .all(|w| w.holder.is_none()));
}
both!(one_agent_watches_a_root_and_another_takes_the_watch_over);

async fn each_agent_records_its_fingerprint_of_a_root(c: Catalog) {
    c.record_root_fingerprint("/ckpt", "a", "[[\"x\",1,2]]", 10, None)
        .await
        .unwrap();
    c.record_root_fingerprint("/ckpt", "b", "[]", 11, Some("differs"))
        .await
        .unwrap();
    // A new record replaces the agent's old one.
    c.record_root_fingerprint("/ckpt", "a", "[[\"x\",1,3]]", 12, None)
        .await
        .unwrap();
    let f = c.root_fingerprints(Some("/ckpt")).await.unwrap();
    assert_eq!(f.len(), 2);
    assert_eq!(
        (f[0].agent.as_str(), f[0].entries.as_str(), f[0].cutoff_ms),
        ("a", "[[\"x\",1,3]]", 12)
    );
    assert_eq!(
        (f[1].agent.as_str(), f[1].refused.as_deref()),
        ("b", Some("differs"))
    );
    assert!(c.root_fingerprints(Some("/none")).await.unwrap().is_empty());
    assert_eq!(c.root_fingerprints(None).await.unwrap().len(), 2);
}
both!(each_agent_records_its_fingerprint_of_a_root);

/// Many agents claim one root's watch at once on PostgreSQL: exactly
/// one gets it.
#[tokio::test]
async fn concurrent_watch_claims_on_postgres_give_one_watcher() {
    let t = TestCatalog::new(Dialect::Postgres).await;
    let c = t.catalog.clone();
    let names: Vec<String> = (0..8).map(|i| format!("agent-{i}")).collect();
    for n in &names {
        c.register_agent(&beat(n, 60_000)).await.unwrap();
    }
    let claims = futures::future::join_all(names.iter().map(|n| {
        let c = c.clone();
        async move { c.claim_watch("/ckpt", n, 60_000).await.unwrap() }
    }))
    .await;
    assert_eq!(
        claims.iter().filter(|c| c.is_some()).count(),
        1,
        "{claims:?}"
    );
    t.finish().await;
}

/// A publish lease: one sink agent at a time per published path, renewed
/// by its heartbeat; a lapsed one is taken over under the next epoch,
/// naming the agent and replica it interrupted; a released one is not a
/// takeover.
async fn one_sink_agent_publishes_into_a_path_and_another_takes_a_lapsed_lease_over(c: Catalog) {
    c.register_agent(&beat("a", 300)).await.unwrap();
    c.register_agent(&beat("b", 60_000)).await.unwrap();
    let first = c
        .claim_publish("/eval/x", 7, "a", 300)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((first.epoch, first.took_over_from), (1, None));
    // Renewing keeps the epoch; another agent cannot take a live lease.
    let again = c
        .claim_publish("/eval/x", 7, "a", 300)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.epoch, 1);
    assert_eq!(
        c.claim_publish("/eval/x", 8, "b", 60_000).await.unwrap(),
        None
    );
    let h = c.publish_holder("/eval/x").await.unwrap().unwrap();
    assert_eq!((h.agent.as_str(), h.replica), ("a", Some(7)));
    assert!(h.left_ms <= 300, "{h:?}");
    // Another path is independent.
    let other = c
        .claim_publish("/eval/y", 9, "b", 60_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(other.epoch, 1);
    // a stops heartbeating: its lease lapses, is not renewed, and b takes
    // the publish over.
    wait_past(&c, c.db_now_ms().await.unwrap() + 300).await;
    assert_eq!(c.publish_holder("/eval/x").await.unwrap(), None);
    let taken = c
        .claim_publish("/eval/x", 7, "b", 60_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (taken.epoch, taken.took_over_from),
        (2, Some(("a".to_string(), Some(7))))
    );
    let late = c.heartbeat(&beat("a", 300)).await.unwrap();
    assert!(late.publishes.is_empty(), "{late:?}");
    assert!(!c.release_publish("/eval/x", "a", 1).await.unwrap());
    let b = c.heartbeat(&beat("b", 60_000)).await.unwrap();
    assert_eq!(
        b.publishes,
        vec!["/eval/x".to_string(), "/eval/y".to_string()]
    );
    // Released: free, and the next claim is no takeover.
    assert!(!c.release_publish("/eval/x", "b", 1).await.unwrap());
    assert!(c.release_publish("/eval/x", "b", 2).await.unwrap());
    assert_eq!(c.publish_holder("/eval/x").await.unwrap(), None);
    let next = c
        .claim_publish("/eval/x", 10, "a", 60_000)
        .await
        .unwrap()
        .unwrap();
    assert_eq!((next.epoch, next.took_over_from), (3, None));
}
both!(one_sink_agent_publishes_into_a_path_and_another_takes_a_lapsed_lease_over);

/// Many sink agents claim one path's publish lease at once on
/// PostgreSQL: exactly one gets it.
#[tokio::test]
async fn concurrent_publish_claims_on_postgres_give_one_publisher() {
    let t = TestCatalog::new(Dialect::Postgres).await;
    let c = t.catalog.clone();
    let names: Vec<String> = (0..8).map(|i| format!("sink-{i}")).collect();
    let claims = futures::future::join_all(names.iter().map(|n| {
        let c = c.clone();
        async move { c.claim_publish("/eval/x", 1, n, 60_000).await.unwrap() }
    }))
    .await;
    assert_eq!(
        claims.iter().filter(|c| c.is_some()).count(),
        1,
        "{claims:?}"
    );
    t.finish().await;
}

fn plan_files() -> Vec<ferry_proto::manifest::FileInfo> {
    ["a", "b", "c"]
        .iter()
        .map(|p| ferry_proto::manifest::FileInfo {
            path: (*p).into(),
            size: 4 << 20,
            mode: 0o644,
            mtime_ns: 7,
        })
        .collect()
}

/// A striped transfer: the plan is stored once, parts are claimed once
/// each, a lapsed part is taken over under the next epoch (its claim
/// ended at its lease's end, before the next began), a stale holder
/// cannot release it, and the heartbeat renews what an agent holds.
async fn parts_are_claimed_once_and_a_lapsed_part_is_taken_over(c: Catalog) {
    let id = queued(&c).await;
    for a in ["a", "b"] {
        c.register_agent(&beat(a, 60_000)).await.unwrap();
    }
    let files = plan_files();
    let plan = c
        .plan_transfer(id, &files, &[2], 1 << 20, 2 << 20, "a")
        .await
        .unwrap();
    assert_eq!(
        (plan.files.clone(), plan.markers.clone()),
        (files.clone(), vec![2])
    );
    // A second plan (a coordinator that took over) gets the first one.
    let other = vec![files[0].clone()];
    let again = c
        .plan_transfer(id, &other, &[], 1 << 20, 8 << 20, "b")
        .await
        .unwrap();
    assert_eq!(
        (again.files, again.planned_by.as_str()),
        (files.clone(), "a")
    );
    let st = c.parts_status(id).await.unwrap();
    assert_eq!((st.total, st.claimable, st.done), (6, 6, 0));
    assert_eq!(
        c.claimable_transfers(&[id]).await.unwrap(),
        vec![Claimable {
            transfer: id,
            parts: 6
        }]
    );
    let a = c.claim_parts(id, "a", 2, 60_000).await.unwrap();
    assert_eq!(
        a.iter()
            .map(|p| (p.range.part, p.epoch))
            .collect::<Vec<_>>(),
        [(0, 1), (1, 1)]
    );
    // b gets the next ones, one short lease among them.
    let b = c.claim_parts(id, "b", 1, 300).await.unwrap();
    assert_eq!(b[0].range.part, 2);
    let rest = c.claim_parts(id, "b", 10, 60_000).await.unwrap();
    assert_eq!(
        rest.iter().map(|p| p.range.part).collect::<Vec<_>>(),
        [3, 4, 5]
    );
    assert!(c.claim_parts(id, "a", 2, 60_000).await.unwrap().is_empty());
    // Two agents hold its parts: each is due half of its share.
    assert_eq!(
        c.part_holders(&[id], "a").await.unwrap(),
        vec![(id, 2, true)]
    );
    assert_eq!(
        c.part_holders(&[id], "z").await.unwrap(),
        vec![(id, 2, false)]
    );
    // The heartbeat renews a's parts, and says which.
    let beat_a = c.heartbeat(&beat("a", 60_000)).await.unwrap();
    assert_eq!(beat_a.parts, vec![(id, 0), (id, 1)]);
    // b's short lease lapses: a takes part 2 over under epoch 2.
    wait_past(&c, c.db_now_ms().await.unwrap() + 400).await;
    let over = c.claim_parts(id, "a", 4, 60_000).await.unwrap();
    assert_eq!(over.len(), 1);
    assert_eq!(
        (
            over[0].range.part,
            over[0].epoch,
            over[0].took_over_from.as_deref()
        ),
        (2, 2, Some("b"))
    );
    // b, resumed, can neither release nor give it back.
    let h = [[1u8; 32]; 2];
    assert!(!c.release_part(id, 2, "b", 1, &h, &[]).await.unwrap());
    assert!(!c.give_back_part(id, 2, "b", 1).await.unwrap());
    let read = PartFileRead {
        file: 1,
        before: (4 << 20, 7, [1, 2, 3, 4]),
        after: (4 << 20, 7, [1, 2, 3, 4]),
    };
    assert!(c.release_part(id, 2, "a", 2, &h, &[read]).await.unwrap());
    assert!(!c.release_part(id, 2, "a", 2, &h, &[read]).await.unwrap());
    assert!(c.give_back_part(id, 0, "a", 1).await.unwrap());
    let parts = c.parts(id).await.unwrap();
    assert_eq!(parts[2].state, PartState::Done);
    assert_eq!(
        (parts[2].hashes.clone(), parts[2].versions.clone()),
        (h.to_vec(), vec![read])
    );
    assert_eq!(parts[2].done_by.as_deref(), Some("a"));
    assert_eq!(
        (parts[0].state, parts[0].holder.clone()),
        (PartState::Queued, None)
    );
    let st = c.parts_status(id).await.unwrap();
    assert_eq!((st.done, st.held, st.claimable), (1, 4, 1));
    // No two claims of one part overlap in time (database clock).
    let claims = c.part_claims(id).await.unwrap();
    let p2: Vec<_> = claims.iter().filter(|r| r.part == 2).collect();
    assert_eq!(p2.len(), 2);
    assert_eq!(p2[0].end_reason.as_deref(), Some("lapsed"));
    assert!(p2[0].ended_at.unwrap() <= p2[1].claimed_at, "{p2:?}");
    assert_eq!(p2[1].end_reason.as_deref(), Some("released"));
    // Requeued after a file changed: hashes forgotten.
    c.requeue_parts(id, &[2]).await.unwrap();
    let parts = c.parts(id).await.unwrap();
    assert_eq!(
        (parts[2].state, parts[2].hashes.len()),
        (PartState::Queued, 0)
    );
    // An agent that stops gives its parts back.
    c.agent_stopped("b", "p1").await.unwrap();
    let st = c.parts_status(id).await.unwrap();
    assert_eq!((st.held, st.claimable), (1, 5));
    // A drained agent claims nothing.
    c.set_agent_draining("a", true).await.unwrap();
    assert!(c.claim_parts(id, "a", 4, 60_000).await.unwrap().is_empty());
    c.drop_plan(id).await.unwrap();
    assert_eq!(c.transfer_plan(id).await.unwrap(), None);
    assert_eq!(c.parts_status(id).await.unwrap().total, 0);
    // Planned again (a file changed size): the new parts' claims come
    // after every earlier epoch, and their claim rows do not collide with
    // the old ones.
    let old_max = claims.iter().map(|r| r.epoch).max().unwrap();
    c.plan_transfer(id, &files, &[2], 1 << 20, 2 << 20, "b")
        .await
        .unwrap();
    let again = c.claim_parts(id, "b", 2, 60_000).await.unwrap();
    assert_eq!(again.len(), 2);
    assert!(again.iter().all(|cl| cl.epoch == old_max + 1), "{again:?}");
    // Published: the parts forget their hashes and versions, not their
    // states or claims.
    let cl = &again[0];
    assert!(c
        .release_part(id, cl.range.part, "b", cl.epoch, &h, &[read])
        .await
        .unwrap());
    c.set_transfer_published(id, "00", "/replica")
        .await
        .unwrap();
    let p = c.parts(id).await.unwrap();
    let done = p.iter().find(|p| p.range.part == cl.range.part).unwrap();
    assert_eq!(
        (done.state, done.hashes.len(), done.versions.len()),
        (PartState::Done, 0, 0)
    );
    assert!(!c.part_claims(id).await.unwrap().is_empty());
}
both!(parts_are_claimed_once_and_a_lapsed_part_is_taken_over);

/// A plan dropped and stored again is another plan: its `planned_at`
/// differs (a helper that read the first stops claiming by it), while
/// reading a plan twice gives the same.
async fn a_plan_stored_again_is_told_apart(c: Catalog) {
    let id = queued(&c).await;
    c.register_agent(&beat("a", 60_000)).await.unwrap();
    let first = c
        .plan_transfer(id, &plan_files(), &[], 1 << 20, 2 << 20, "a")
        .await
        .unwrap();
    let read = c.transfer_plan(id).await.unwrap().unwrap();
    assert_eq!(
        (read.planned_at, &read.planned_by),
        (first.planned_at, &first.planned_by)
    );
    c.drop_plan(id).await.unwrap();
    assert!(c.transfer_plan(id).await.unwrap().is_none());
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let again = c
        .plan_transfer(id, &plan_files(), &[], 1 << 20, 2 << 20, "a")
        .await
        .unwrap();
    assert_eq!(again.files, first.files);
    assert!(again.planned_at > first.planned_at, "{again:?} {first:?}");
}
both!(a_plan_stored_again_is_told_apart);

/// A plan stored quietly is its maker's alone: not offered to other
/// agents, their claims get nothing, the maker's succeed; once announced
/// (once only) every agent may claim. Plans stored the usual way are
/// announced at once.
async fn a_quiet_plan_is_its_maker_s_until_announced(c: Catalog) {
    let id = queued(&c).await;
    for a in ["a", "b"] {
        c.register_agent(&beat(a, 60_000)).await.unwrap();
    }
    let plan = c
        .plan_transfer_quietly(id, &plan_files(), &[], 1 << 20, 2 << 20, "a")
        .await
        .unwrap();
    assert!(!plan.announced);
    assert!(c.claimable_transfers(&[id]).await.unwrap().is_empty());
    assert!(c.claim_parts(id, "b", 2, 60_000).await.unwrap().is_empty());
    // What agents from before migration 0021 claim (they ignore the
    // plan's flag): queued parts and lapsed held ones. None until the
    // plan is announced.
    let old_agents_see = || async {
        let q = format!(
            "SELECT COUNT(*) FROM transfer_parts WHERE transfer = {} AND (state = 'queued' \
             OR (state = 'held' AND lease_until < {}))",
            id.as_i64(),
            c.db.now_ms()
        );
        sqlx::query_scalar::<_, i64>(&q)
            .fetch_one(&c.pool)
            .await
            .unwrap()
    };
    assert_eq!(old_agents_see().await, 0);
    let mine = c.claim_parts(id, "a", 2, 60_000).await.unwrap();
    assert_eq!(mine.len(), 2);
    // A part given back before the announcement stays the maker's.
    let back = &mine[1];
    assert!(c
        .give_back_part(id, back.range.part, "a", back.epoch)
        .await
        .unwrap());
    assert_eq!(old_agents_see().await, 0);
    // So does a done part queued again (a file changed before the seal).
    let first = &mine[0];
    let h = [[1u8; 32]; 2];
    assert!(c
        .release_part(id, first.range.part, "a", first.epoch, &h, &[])
        .await
        .unwrap());
    c.requeue_parts(id, &[first.range.part]).await.unwrap();
    assert_eq!(old_agents_see().await, 0);
    let mine = c.claim_parts(id, "a", 1, 60_000).await.unwrap();
    assert_eq!(mine.len(), 1);
    assert_eq!(mine[0].range.part, first.range.part);
    let parts = c.parts(id).await.unwrap();
    assert_eq!(parts[back.range.part as usize].state, PartState::Queued);
    assert!(c.claim_parts(id, "b", 2, 60_000).await.unwrap().is_empty());
    assert!(c
        .claimable_transfers_for(&[id], true)
        .await
        .unwrap()
        .is_empty());
    // Announced to the agents whose sink takes joining opens: they may
    // claim; agents without such a sink, and agents from before it, may
    // not (its parts stay quiet).
    assert!(c.announce_plan_to_joiners(id).await.unwrap());
    assert!(
        !c.announce_plan_to_joiners(id).await.unwrap(),
        "announced twice"
    );
    let p = c.transfer_plan(id).await.unwrap().unwrap();
    assert!(p.joinable && !p.announced, "{p:?}");
    assert!(c.claimable_transfers(&[id]).await.unwrap().is_empty());
    assert_eq!(
        c.claimable_transfers_for(&[id], true)
            .await
            .unwrap()
            .into_iter()
            .map(|cl| cl.transfer)
            .collect::<Vec<_>>(),
        [id]
    );
    assert!(c.claim_parts(id, "b", 1, 60_000).await.unwrap().is_empty());
    // Agents from before migration 0022 read only `announced`: still 0.
    let announced: i64 = sqlx::query_scalar(&format!(
        "SELECT announced FROM transfer_plans WHERE transfer = {}",
        id.as_i64()
    ))
    .fetch_one(&c.pool)
    .await
    .unwrap();
    assert_eq!(announced, 0);
    let joined = c.claim_parts_for(id, "b", 2, 60_000, true).await.unwrap();
    assert_eq!(joined.len(), 2);
    assert_eq!(old_agents_see().await, 0);
    // Given back (a run of "b" stopped), they stay out of reach of the
    // others; nothing of "b"'s is left held.
    assert_eq!(c.give_back_parts_of(id, "b").await.unwrap(), 2);
    assert_eq!(c.give_back_parts_of(id, "b").await.unwrap(), 0);
    assert_eq!(old_agents_see().await, 0);
    assert!(c
        .parts(id)
        .await
        .unwrap()
        .iter()
        .all(|p| p.holder.as_deref() != Some("b")));
    assert!(c.announce_plan(id).await.unwrap());
    let queued_now = old_agents_see().await;
    assert_eq!(
        queued_now as usize,
        parts.len() - 1,
        "every part but the held one queued for all at the announcement"
    );
    assert!(!c.announce_plan(id).await.unwrap(), "announced twice");
    assert!(c.transfer_plan(id).await.unwrap().unwrap().announced);
    assert_eq!(
        c.claimable_transfers(&[id])
            .await
            .unwrap()
            .into_iter()
            .map(|cl| cl.transfer)
            .collect::<Vec<_>>(),
        [id]
    );
    assert_eq!(c.claim_parts(id, "b", 1, 60_000).await.unwrap().len(), 1);
    let other = queued(&c).await;
    let p = c
        .plan_transfer(other, &plan_files(), &[], 1 << 20, 2 << 20, "a")
        .await
        .unwrap();
    assert!(p.announced);
}
both!(a_quiet_plan_is_its_maker_s_until_announced);

/// Claim order across transfers: class first (a lower class's parts are
/// not claimed while a higher one's are left), then the fewest claimed
/// bytes per unit of weight.
async fn transfers_are_claimed_by_class_then_fair_share(c: Catalog) {
    let (x, y, z) = (queued(&c).await, queued(&c).await, queued(&c).await);
    c.register_agent(&beat("a", 60_000)).await.unwrap();
    for id in [x, y, z] {
        c.plan_transfer(id, &plan_files(), &[], 1 << 20, 2 << 20, "a")
            .await
            .unwrap();
    }
    c.set_plan_rank(x, 0, 1.0).await.unwrap();
    c.set_plan_rank(y, 1, 1.0).await.unwrap();
    c.set_plan_rank(z, 1, 3.0).await.unwrap();
    let order = |v: Vec<Claimable>| v.into_iter().map(|c| c.transfer).collect::<Vec<_>>();
    // y and z are scheduled, x background: only the scheduled ones are
    // offered, and x's parts cannot be claimed while theirs are left.
    let first = order(c.claimable_transfers(&[x, y, z]).await.unwrap());
    assert_eq!(first.len(), 2, "{first:?}");
    assert!(!first.contains(&x));
    assert!(c.claim_parts(x, "a", 1, 60_000).await.unwrap().is_empty());
    c.claim_parts(y, "a", 1, 60_000).await.unwrap();
    // y has 2 MiB per unit of weight claimed, z none: z first.
    assert_eq!(
        order(c.claimable_transfers(&[x, y, z]).await.unwrap()),
        [z, y]
    );
    c.claim_parts(z, "a", 2, 60_000).await.unwrap();
    // z: 4 MiB / 3 < y: 2 MiB / 1.
    assert_eq!(
        order(c.claimable_transfers(&[x, y, z]).await.unwrap()),
        [z, y]
    );
    c.claim_parts(z, "a", 1, 60_000).await.unwrap();
    // z: 6 MiB / 3 = y: 2 MiB / 1; ties go by id (y first).
    assert_eq!(
        order(c.claimable_transfers(&[x, y, z]).await.unwrap()),
        [y, z]
    );
    // Asked about x alone, it is not offered either (its claims would be
    // refused): an agent does not start a sender that claims nothing.
    assert!(c.claimable_transfers(&[x]).await.unwrap().is_empty());
    // Once y and z have nothing left to claim, x's parts go.
    while !c.claim_parts(y, "a", 8, 60_000).await.unwrap().is_empty() {}
    while !c.claim_parts(z, "a", 8, 60_000).await.unwrap().is_empty() {}
    assert_eq!(c.claim_parts(x, "a", 1, 60_000).await.unwrap().len(), 1);
    // A signal makes x urgent: its parts go before the others'.
    c.set_plan_rank(x, 2, 1.0).await.unwrap();
    assert_eq!(order(c.claimable_transfers(&[x, y, z]).await.unwrap()), [x]);
}
both!(transfers_are_claimed_by_class_then_fair_share);

/// A plan of given parts (a watched checkpoint's rest at its commit)
/// stores exactly those; parts out of order or overlapping are refused
/// and store nothing. On PostgreSQL, storing a plan is announced to the
/// pool's listeners; finding one stored already is not.
#[tokio::test]
async fn a_plan_of_given_parts_is_stored_as_given_and_announced() {
    let t = TestCatalog::new(Dialect::Postgres).await;
    let c = t.catalog.clone();
    let id = queued(&c).await;
    let mut l = c
        .listen_pool(std::time::Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    let files = plan_files();
    let range = |part, first_key, end_key| PartRange {
        part,
        first_key,
        end_key,
        bytes: (end_key - first_key) << 20,
    };
    // b's chunks 1..4 and c's 0..2 (a and the rest were sent already).
    let given = [
        range(0, 1 << 32 | 1, 1 << 32 | 4),
        range(1, 2 << 32, 2 << 32 | 2),
    ];
    for bad in [
        vec![given[1], given[0]],
        vec![given[0], range(1, 1 << 32 | 3, 1 << 32 | 5)],
    ] {
        let e = c
            .plan_transfer_parts(id, &files, &[], 1 << 20, 4 << 20, "a", &bad)
            .await
            .unwrap_err();
        assert!(e.to_string().contains("key order"), "{e}");
    }
    assert_eq!(c.transfer_plan(id).await.unwrap(), None);
    c.plan_transfer_parts(id, &files, &[], 1 << 20, 4 << 20, "a", &given)
        .await
        .unwrap();
    let heard = tokio::time::timeout(std::time::Duration::from_secs(10), l.recv())
        .await
        .expect("a notification within 10 s")
        .unwrap();
    assert_eq!(heard.as_deref(), Some(crate::notify::payload::PLAN));
    let stored: Vec<PartRange> = c.parts(id).await.unwrap().iter().map(|p| p.range).collect();
    assert_eq!(stored, given);
    // Planned again (a second agent): the stored plan, not announced.
    c.plan_transfer(id, &files, &[], 1 << 20, 4 << 20, "b")
        .await
        .unwrap();
    let quiet = tokio::time::timeout(std::time::Duration::from_millis(500), l.recv()).await;
    assert!(quiet.is_err(), "announced again: {quiet:?}");
    // A plan stored quietly is announced by announce_plan, not before.
    let other = queued(&c).await;
    c.plan_transfer_quietly(other, &files, &[], 1 << 20, 4 << 20, "a")
        .await
        .unwrap();
    let quiet = tokio::time::timeout(std::time::Duration::from_millis(500), l.recv()).await;
    assert!(quiet.is_err(), "a quiet plan announced: {quiet:?}");
    assert!(c.announce_plan(other).await.unwrap());
    let heard = tokio::time::timeout(std::time::Duration::from_secs(10), l.recv())
        .await
        .expect("a notification within 10 s of announce_plan")
        .unwrap();
    assert_eq!(heard.as_deref(), Some(crate::notify::payload::PLAN));
    // An agent's first claim of the transfer changes its holders and is
    // announced; a further claim while it holds parts is not.
    let half_s = std::time::Duration::from_millis(500);
    assert_eq!(c.claim_parts(other, "b", 1, 60_000).await.unwrap().len(), 1);
    let heard = tokio::time::timeout(half_s, l.recv())
        .await
        .expect("a notification of the first claim");
    assert_eq!(
        heard.unwrap().as_deref(),
        Some(crate::notify::payload::HOLDERS)
    );
    assert_eq!(c.claim_parts(other, "b", 1, 60_000).await.unwrap().len(), 1);
    let quiet = tokio::time::timeout(half_s, l.recv()).await;
    assert!(quiet.is_err(), "a further claim announced: {quiet:?}");
    // Another agent takes the rest (its first claim: announced).
    let total = c.parts(other).await.unwrap().len();
    assert!(total > 2, "{total} parts");
    let rest = c.claim_parts(other, "c", total, 60_000).await.unwrap();
    assert_eq!(rest.len(), total - 2);
    let heard = tokio::time::timeout(half_s, l.recv())
        .await
        .expect("a notification of c's first claim");
    assert_eq!(
        heard.unwrap().as_deref(),
        Some(crate::notify::payload::HOLDERS)
    );
    // b ends its parts: the first while it holds another is not
    // announced; its last, with nothing left to claim, is.
    let b_parts: Vec<_> = c
        .parts(other)
        .await
        .unwrap()
        .into_iter()
        .filter(|p| p.holder.as_deref() == Some("b"))
        .collect();
    assert_eq!(b_parts.len(), 2);
    let (first, last) = (&b_parts[0], &b_parts[1]);
    assert!(c
        .release_part(other, first.range.part, "b", first.epoch, &[], &[])
        .await
        .unwrap());
    let quiet = tokio::time::timeout(half_s, l.recv()).await;
    assert!(
        quiet.is_err(),
        "a release while holding another announced: {quiet:?}"
    );
    assert!(c
        .release_part(other, last.range.part, "b", last.epoch, &[], &[])
        .await
        .unwrap());
    let heard = tokio::time::timeout(half_s, l.recv())
        .await
        .expect("a notification of b's last release");
    assert_eq!(
        heard.unwrap().as_deref(),
        Some(crate::notify::payload::HOLDERS)
    );
    drop(l);
    t.finish().await;
}

/// Many source agents claim one transfer's parts at once on
/// PostgreSQL: every part goes to exactly one of them.
#[tokio::test]
async fn concurrent_part_claims_on_postgres_give_each_part_once() {
    let t = TestCatalog::new(Dialect::Postgres).await;
    let c = t.catalog.clone();
    let id = queued(&c).await;
    let names: Vec<String> = (0..8).map(|i| format!("source-{i}")).collect();
    for n in &names {
        c.register_agent(&beat(n, 60_000)).await.unwrap();
    }
    c.plan_transfer(id, &plan_files(), &[], 1 << 20, 1 << 20, "source-0")
        .await
        .unwrap();
    let claims = futures::future::join_all(names.iter().map(|n| {
        let c = c.clone();
        async move { c.claim_parts(id, n, 2, 60_000).await.unwrap() }
    }))
    .await;
    let mut parts: Vec<u64> = claims.iter().flatten().map(|p| p.range.part).collect();
    parts.sort_unstable();
    let mut unique = parts.clone();
    unique.dedup();
    assert_eq!(parts, unique, "a part claimed twice: {claims:?}");
    assert_eq!(parts.len(), 12, "{claims:?}");
    t.finish().await;
}

/// Sink side: a part's epoch only moves forward; the later sender's
/// registration wins and an older one learns it.
async fn part_epochs_only_move_forward(c: Catalog) {
    let r = PartRange {
        part: 3,
        first_key: 1 << 32,
        end_key: (1 << 32) + 2,
        bytes: 0,
    };
    assert_eq!(
        c.register_part_epoch(7, r, 1, "train-a-1").await.unwrap(),
        1
    );
    assert_eq!(
        c.register_part_epoch(7, r, 2, "train-a-2").await.unwrap(),
        2
    );
    // The paused agent, resumed, registers its old epoch again: refused.
    assert_eq!(
        c.register_part_epoch(7, r, 1, "train-a-1").await.unwrap(),
        2
    );
    let other = PartRange { part: 4, ..r };
    assert_eq!(
        c.register_part_epoch(7, other, 1, "train-a-1")
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        c.part_epochs(7, None).await.unwrap(),
        vec![
            PartEpoch { range: r, epoch: 2 },
            PartEpoch {
                range: other,
                epoch: 1
            }
        ]
    );
    // Only the parts asked for.
    assert_eq!(
        c.part_epochs(7, Some(&[4, 99])).await.unwrap(),
        vec![PartEpoch {
            range: other,
            epoch: 1
        }]
    );
    assert!(c.part_epochs(7, Some(&[])).await.unwrap().is_empty());
    assert!(c.part_epochs(8, None).await.unwrap().is_empty());
}
both!(part_epochs_only_move_forward);
