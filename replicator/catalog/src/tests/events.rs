//! The `events` table: each change records exactly its event in its own
//! transaction, and the export builds a trace that parses, with the
//! header and queue as they were at `since`.

use scheduler::trace::{JobSpec, LinkSpec, Trace, What};

use super::*;
use crate::events::{record, Change};

/// Id of the newest event (0 when there is none).
async fn last_id(c: &Catalog) -> i64 {
    sqlx::query_scalar(&c.db.sql("SELECT COALESCE(MAX(id), 0) FROM events"))
        .fetch_one(&c.pool)
        .await
        .unwrap()
}

/// The changes recorded after event `after`, oldest first.
async fn since_id(c: &Catalog, after: i64) -> Vec<Change> {
    c.events_since(i64::MIN)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.id > after)
        .map(|e| e.change)
        .collect()
}

/// Runs `f` and returns the changes it recorded.
macro_rules! recorded {
    ($c:expr, $f:expr) => {{
        let mark = last_id(&$c).await;
        let out = $f;
        (out, since_id(&$c, mark).await)
    }};
}

/// Moves the newest event to `at_ms`, so tests can lay out a history.
async fn stamp(c: &Catalog, at_ms: i64) {
    sqlx::query(
        &c.db
            .sql("UPDATE events SET at_ms = ? WHERE id = (SELECT MAX(id) FROM events)"),
    )
    .bind(at_ms)
    .execute(&c.pool)
    .await
    .unwrap();
}

/// Sets a transfer's `finished_at` (as a publish or failure at that time
/// would).
async fn finished(c: &Catalog, id: TransferId, at_ms: i64) {
    sqlx::query(
        &c.db
            .sql("UPDATE transfers SET finished_at = ? WHERE id = ?"),
    )
    .bind(at_ms)
    .bind(id.as_i64())
    .execute(&c.pool)
    .await
    .unwrap();
}

fn link(name: &str, rate_bps: u64, rtt_ms: u64) -> LinkSpec {
    LinkSpec {
        link: name.into(),
        rate_bps,
        rtt_ms,
    }
}

/// The export of `c` from `since` over `links`, checked to read back
/// through `Trace::parse` unchanged.
async fn export(c: &Catalog, since: i64, links: &[LinkSpec]) -> TraceExport {
    let x = c.export_trace(since, links).await.unwrap();
    let text = x.trace.to_json_lines();
    let back = Trace::parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(back, x.trace);
    x
}

fn arrival(id: TransferId, link: &str, class: Class) -> Change {
    arrival_with(id, link, class, None, None)
}

fn arrival_with(
    id: TransferId,
    link: &str,
    class: Class,
    importance: Option<f64>,
    bytes: Option<u64>,
) -> Change {
    Change::Arrival {
        transfer: id,
        link: link.into(),
        job: "j".into(),
        class,
        importance,
        bytes,
    }
}

async fn each_change_records_exactly_its_event(c: Catalog) {
    let (id, got) = recorded!(
        c,
        c.insert_transfer("l", "j", "/ck/a", "a", Class::Background)
            .await
            .unwrap()
    );
    assert_eq!(got, [arrival(id, "l", Class::Background)]);
    let t = c.transfer(id).await.unwrap().unwrap();
    let ev = c.events_since(0).await.unwrap();
    assert_eq!(ev.last().unwrap().at_ms, t.created_at);

    let (w, got) = recorded!(
        c,
        c.insert_watched_transfer(&NewWatchedTransfer {
            link: "m",
            job: "j",
            source_path: "/ck/b",
            rel: "b",
            class: Class::Scheduled,
            checkpoint: ferry_proto::state::CheckpointState::Open,
            format: "dcp",
            opened_at: Some(1),
            committed_at: None,
            profile: Profile::Full,
        })
        .await
        .unwrap()
    );
    assert_eq!(got, [arrival(w, "m", Class::Scheduled)]);

    // An operator's class and importance: one event each, in that order.
    let (ok, got) = recorded!(
        c,
        c.reprioritise_transfer(id, Some(Class::Urgent), Some(Some(0.4)))
            .await
            .unwrap()
    );
    assert!(ok);
    assert_eq!(
        got,
        [
            Change::Class {
                transfer: id,
                class: Class::Urgent
            },
            Change::Importance {
                transfer: id,
                importance: Some(0.4)
            }
        ]
    );
    let (_, got) = recorded!(
        c,
        c.reprioritise_transfer(id, None, Some(None)).await.unwrap()
    );
    assert_eq!(
        got,
        [Change::Importance {
            transfer: id,
            importance: None
        }]
    );
    let (e, got) = recorded!(
        c,
        c.reprioritise_transfer(id, Some(Class::Scheduled), Some(Some(1.5)))
            .await
    );
    assert!(e.unwrap_err().to_string().contains("importance"));
    assert_eq!(got, []);

    // What the agent does by itself is not recorded.
    let (_, got) = recorded!(c, {
        c.promote_urgent(id, now_ms() + 60_000, 1).await.unwrap();
        c.set_transfer_state(id, TransferState::Active, None)
            .await
            .unwrap();
        c.set_transfer_size(id, 100, 1).await.unwrap();
        c.note_transfer_progress(
            id,
            ProgressNote {
                bytes_total: 100,
                bytes_done: 10,
                bytes_sent: 10,
            },
        )
        .await
        .unwrap();
        c.set_transfer_state(w, TransferState::Failed, Some("disk"))
            .await
            .unwrap();
    });
    assert_eq!(got, []);

    // Pause, resume and cancel: an event when they change the state, none
    // when they do not.
    let (ok, got) = recorded!(c, c.pause_transfer(id).await.unwrap());
    assert!(ok);
    assert_eq!(got, [Change::Pause { transfer: id }]);
    assert_eq!(
        c.transfer(id).await.unwrap().unwrap().state,
        TransferState::Paused
    );
    let (ok, got) = recorded!(c, c.pause_transfer(id).await.unwrap());
    assert!(!ok);
    assert_eq!(got, []);
    let (ok, got) = recorded!(c, c.resume_transfer(id).await.unwrap());
    assert!(ok);
    assert_eq!(got, [Change::Resume { transfer: id }]);
    assert_eq!(
        c.transfer(id).await.unwrap().unwrap().state,
        TransferState::Queued
    );
    let (ok, got) = recorded!(c, c.resume_transfer(id).await.unwrap());
    assert!(!ok, "a queued transfer is not resumed");
    assert_eq!(got, []);
    let (ok, got) = recorded!(c, c.cancel_transfer(id, "by hand").await.unwrap());
    assert!(ok);
    assert_eq!(got, [Change::Cancel { transfer: id }]);
    let t = c.transfer(id).await.unwrap().unwrap();
    assert_eq!(
        (t.state, t.error.as_deref()),
        (TransferState::Cancelled, Some("by hand"))
    );
    let at = c.events_since(0).await.unwrap().last().unwrap().at_ms;
    assert_eq!(t.finished_at, Some(at));
    // Nothing more happens to a finished transfer, nor to one that does
    // not exist.
    let (_, got) = recorded!(c, {
        for t in [id, w, TransferId(999)] {
            assert!(!c.cancel_transfer(t, "again").await.unwrap());
            assert!(!c.pause_transfer(t).await.unwrap());
            assert!(!c.resume_transfer(t).await.unwrap());
            assert!(!c
                .reprioritise_transfer(t, Some(Class::Urgent), Some(Some(0.5)))
                .await
                .unwrap());
        }
    });
    assert_eq!(got, []);
    assert_eq!(
        c.transfer(w).await.unwrap().unwrap().state,
        TransferState::Failed
    );

    // Jobs: a new job and each new value, not the same values again.
    let job = |model_params, importance| Change::Job {
        job: "j".into(),
        model_params,
        importance,
    };
    let (_, got) = recorded!(c, c.put_job("j", Some(7e9), 0.5).await.unwrap());
    assert_eq!(got, [job(Some(7e9), 0.5)]);
    let (_, got) = recorded!(c, c.put_job("j", Some(7e9), 0.5).await.unwrap());
    assert_eq!(got, []);
    let (_, got) = recorded!(c, c.put_job("j", Some(7e9), 0.9).await.unwrap());
    assert_eq!(got, [job(Some(7e9), 0.9)]);
    let (_, got) = recorded!(c, c.put_job("j", None, 0.9).await.unwrap());
    assert_eq!(got, [job(None, 0.9)]);
    let (_, got) = recorded!(c, c.put_job("j", Some(0.0), 0.9).await.unwrap());
    assert_eq!(got, [], "0 parameters is the unknown size it has");
    let (e, got) = recorded!(c, c.put_job("j", None, 2.0).await);
    assert!(matches!(e, Err(CatalogError::Invalid(_))));
    assert_eq!(got, []);

    // Signals: a new one, not a retry with its key nor a refused one.
    let (s, got) = recorded!(
        c,
        c.insert_signal("j", "loss_spike", 0.8, Some(10), Some("k"))
            .await
            .unwrap()
    );
    assert!(s.1);
    assert_eq!(
        got,
        [Change::Signal {
            job: "j".into(),
            kind: "loss_spike".into(),
            severity: 0.8
        }]
    );
    let at = c.events_since(0).await.unwrap().last().unwrap().at_ms;
    assert_eq!(at, s.0.received_at);
    let (_, got) = recorded!(c, {
        let (_, new) = c
            .insert_signal("j", "nan", 0.1, None, Some("k"))
            .await
            .unwrap();
        assert!(!new);
        assert!(c.insert_signal("j", "nan", 1.1, None, None).await.is_err());
    });
    assert_eq!(got, []);

    // A rate cap: the event is its record.
    let (_, got) = recorded!(c, c.record_link_rate("l", 5_000).await.unwrap());
    assert_eq!(
        got,
        [Change::Rate {
            link: "l".into(),
            rate_bps: 5_000
        }]
    );
    let (e, got) = recorded!(c, c.record_link_rate("l", 0).await);
    assert!(e.unwrap_err().to_string().contains("rate_bps"));
    assert_eq!(got, []);
}
both!(each_change_records_exactly_its_event);

async fn a_change_whose_event_cannot_be_written_is_not_made(c: Catalog) {
    let id = c
        .insert_transfer("l", "j", "/ck/a", "a", Class::Scheduled)
        .await
        .unwrap();
    let refuse: &[&str] = match c.db {
        Dialect::Sqlite => &["CREATE TRIGGER no_events BEFORE INSERT ON events \
             BEGIN SELECT RAISE(ABORT, 'events refused'); END"],
        Dialect::Postgres => &[
            "CREATE FUNCTION refuse_events() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN RAISE EXCEPTION 'events refused'; END $$",
            "CREATE TRIGGER no_events BEFORE INSERT ON events \
             FOR EACH ROW EXECUTE FUNCTION refuse_events()",
        ],
    };
    for sql in refuse {
        sqlx::query(sql).execute(&c.pool).await.unwrap();
    }
    let refused = |r: Result<_, CatalogError>| {
        let e = r.expect_err("the change went through without its event");
        assert!(e.to_string().contains("events refused"), "{e}");
    };
    refused(
        c.insert_transfer("l", "j", "/ck/b", "b", Class::Scheduled)
            .await
            .map(|_| ()),
    );
    refused(c.pause_transfer(id).await.map(|_| ()));
    refused(c.cancel_transfer(id, "x").await.map(|_| ()));
    refused(
        c.reprioritise_transfer(id, Some(Class::Urgent), None)
            .await
            .map(|_| ()),
    );
    refused(
        c.reprioritise_transfer(id, None, Some(Some(0.5)))
            .await
            .map(|_| ()),
    );
    refused(c.put_job("j", None, 0.5).await.map(|_| ()));
    refused(
        c.sync_config_jobs(&[("k".into(), None, 0.5)])
            .await
            .map(|_| ()),
    );
    refused(
        c.insert_signal("j", "nan", 0.5, None, None)
            .await
            .map(|_| ()),
    );
    refused(c.record_link_rate("l", 1_000).await);
    // Nothing of it happened.
    let ts = c.transfers(10, 0).await.unwrap();
    assert_eq!(ts.len(), 1);
    let t = &ts[0];
    assert_eq!(
        (t.state, t.class, t.importance),
        (TransferState::Queued, Class::Scheduled, None)
    );
    assert!(c.jobs().await.unwrap().is_empty());
    assert!(c.recent_signals(10).await.unwrap().is_empty());
    assert_eq!(c.events_since(i64::MIN).await.unwrap().len(), 1);

    let drop = match c.db {
        Dialect::Sqlite => "DROP TRIGGER no_events",
        Dialect::Postgres => "DROP TRIGGER no_events ON events",
    };
    sqlx::query(drop).execute(&c.pool).await.unwrap();
    assert!(c.pause_transfer(id).await.unwrap());
    assert_eq!(c.events_since(i64::MIN).await.unwrap().len(), 2);
}
both!(a_change_whose_event_cannot_be_written_is_not_made);

async fn config_rates_and_jobs_are_recorded_when_they_differ(c: Catalog) {
    let rates = |l: u64, m: u64| vec![("l".to_string(), l), ("m".to_string(), m)];
    let rate = |link: &str, rate_bps| Change::Rate {
        link: link.into(),
        rate_bps,
    };
    let (n, got) = recorded!(
        c,
        c.sync_config_link_rates(&rates(1000, 2000)).await.unwrap()
    );
    assert_eq!(n, 2);
    assert_eq!(got, [rate("l", 1000), rate("m", 2000)]);
    let (n, got) = recorded!(
        c,
        c.sync_config_link_rates(&rates(1000, 2000)).await.unwrap()
    );
    assert_eq!((n, got), (0, vec![]), "a restart with the same rates");
    // A rate set through the API lasts until the restart.
    c.record_link_rate("l", 500).await.unwrap();
    let (n, got) = recorded!(
        c,
        c.sync_config_link_rates(&rates(1000, 3000)).await.unwrap()
    );
    assert_eq!(n, 2);
    assert_eq!(got, [rate("l", 1000), rate("m", 3000)]);
    let (e, got) = recorded!(c, c.sync_config_link_rates(&rates(0, 3000)).await);
    let e = e.unwrap_err().to_string();
    assert!(e.contains("\"l\"") && e.contains("rate_bps"), "{e}");
    assert_eq!(got, []);

    let job = |name: &str, model_params, importance| Change::Job {
        job: name.into(),
        model_params,
        importance,
    };
    let (_, got) = recorded!(
        c,
        c.sync_config_jobs(&[("a".into(), Some(7e10), 0.8), ("b".into(), None, 0.2)])
            .await
            .unwrap()
    );
    assert_eq!(got, [job("a", Some(7e10), 0.8), job("b", None, 0.2)]);
    let (_, got) = recorded!(
        c,
        c.sync_config_jobs(&[("a".into(), Some(7e10), 0.8), ("b".into(), Some(0.0), 0.2)])
            .await
            .unwrap()
    );
    assert_eq!(got, [], "a restart with the same jobs");
    // Set through the API, "a" keeps its values over the config's.
    c.put_job("a", Some(1e9), 0.1).await.unwrap();
    let (_, got) = recorded!(
        c,
        c.sync_config_jobs(&[("a".into(), Some(7e10), 0.8), ("b".into(), Some(3e9), 0.2)])
            .await
            .unwrap()
    );
    assert_eq!(got, [job("b", Some(3e9), 0.2)]);
    assert_eq!(c.job("a").await.unwrap().unwrap().importance, 0.1);
}
both!(config_rates_and_jobs_are_recorded_when_they_differ);

async fn export_lines_are_in_time_order_then_row_order(c: Catalog) {
    let links = [link("l", 1_000_000, 20)];
    // Made in this order, at times out of that order.
    let a = c
        .insert_transfer("l", "j", "/ck/a", "a", Class::Scheduled)
        .await
        .unwrap();
    stamp(&c, 1000).await;
    c.insert_signal("j", "nan", 0.5, None, None).await.unwrap();
    stamp(&c, 3000).await;
    c.record_link_rate("l", 2_000).await.unwrap();
    stamp(&c, 2000).await;
    c.pause_transfer(a).await.unwrap();
    stamp(&c, 2000).await;
    c.resume_transfer(a).await.unwrap();
    stamp(&c, 2000).await;
    c.put_job("j", None, 0.5).await.unwrap();
    stamp(&c, 500).await;

    let x = export(&c, 0, &links).await;
    assert_eq!(x.left_out, 0);
    let got: Vec<(i64, &str)> = x
        .trace
        .events
        .iter()
        .map(|e| {
            let kind = match &e.what {
                What::Arrival { .. } => "arrival",
                What::Signal { .. } => "signal",
                What::Rate { .. } => "rate",
                What::Pause { .. } => "pause",
                What::Resume { .. } => "resume",
                What::Job(_) => "job",
                other => panic!("unexpected {other:?}"),
            };
            (e.at_ms, kind)
        })
        .collect();
    assert_eq!(
        got,
        [
            (500, "job"),
            (1000, "arrival"),
            (2000, "rate"),
            (2000, "pause"),
            (2000, "resume"),
            (3000, "signal"),
        ]
    );
    assert_eq!(
        x.trace.events[5].what,
        What::Signal {
            job: "j".into(),
            severity: 0.5,
            kind: Some("nan".into())
        }
    );
    // Only the events at or after `since` are lines.
    let x = export(&c, 2000, &links).await;
    let times: Vec<i64> = x.trace.events.iter().map(|e| e.at_ms).collect();
    assert_eq!(
        times,
        [2000, 2000, 2000, 2000, 3000],
        "{:?}",
        x.trace.events
    );
    assert!(
        matches!(x.trace.events[0].what, What::Arrival { id, .. } if id == a),
        "the transfer queued at 2000 arrives then: {:?}",
        x.trace.events[0]
    );
}
both!(export_lines_are_in_time_order_then_row_order);

async fn export_header_has_the_rates_and_jobs_in_force_at_since(c: Catalog) {
    let links = [link("l", 1000, 20), link("m", 2000, 30)];
    c.record_link_rate("l", 500).await.unwrap();
    stamp(&c, 1000).await;
    c.record_link_rate("l", 700).await.unwrap();
    stamp(&c, 6000).await;
    c.put_job("a", Some(7e9), 0.2).await.unwrap();
    stamp(&c, 1000).await;
    c.put_job("a", Some(7e9), 0.9).await.unwrap();
    stamp(&c, 6000).await;
    c.put_job("b", None, 0.4).await.unwrap();
    stamp(&c, 7000).await;
    // A job with no event (as none is since catalog version 5): from the
    // jobs table.
    c.put_job("c", Some(1e9), 0.3).await.unwrap();
    sqlx::query(&c.db.sql("DELETE FROM events WHERE job = 'c'"))
        .execute(&c.pool)
        .await
        .unwrap();

    let rates = |x: &TraceExport| -> Vec<(String, u64, u64)> {
        x.trace
            .header
            .links
            .iter()
            .map(|l| (l.link.clone(), l.rate_bps, l.rtt_ms))
            .collect()
    };
    let spec = |job: &str, model_params, importance| JobSpec {
        job: job.into(),
        model_params,
        importance,
    };
    let x = export(&c, 0, &links).await;
    assert_eq!(
        rates(&x),
        [("l".into(), 1000, 20), ("m".into(), 2000, 30)],
        "no rate event yet: the configured rates"
    );
    assert_eq!(x.trace.header.jobs, [spec("c", Some(1e9), 0.3)]);
    assert_eq!(x.trace.header.ferry_trace, 1);

    let x = export(&c, 5000, &links).await;
    assert_eq!(rates(&x), [("l".into(), 500, 20), ("m".into(), 2000, 30)]);
    assert_eq!(
        x.trace.header.jobs,
        [spec("a", Some(7e9), 0.2), spec("c", Some(1e9), 0.3)],
        "b is first set after 5000: its line brings it in"
    );
    let lines: Vec<&What> = x.trace.events.iter().map(|e| &e.what).collect();
    assert_eq!(
        lines,
        [
            &What::Rate {
                link: "l".into(),
                rate_bps: 700
            },
            &What::Job(spec("a", Some(7e9), 0.9)),
            &What::Job(spec("b", None, 0.4)),
        ]
    );
    // At or before: an event at `since` counts for the header.
    let x = export(&c, 6000, &links).await;
    assert_eq!(rates(&x), [("l".into(), 700, 20), ("m".into(), 2000, 30)]);
    assert_eq!(x.trace.header.jobs[0], spec("a", Some(7e9), 0.9));
}
both!(export_header_has_the_rates_and_jobs_in_force_at_since);

async fn export_queues_again_what_was_unfinished_at_since_as_it_was(c: Catalog) {
    let links = [link("l", 1000, 20)];
    let push = |name: &'static str, at: i64| {
        let c = c.clone();
        async move {
            let id = c
                .insert_transfer("l", "j", &format!("/ck/{name}"), name, Class::Scheduled)
                .await
                .unwrap();
            stamp(&c, at).await;
            c.set_transfer_size(id, 100 + at as u64, 1).await.unwrap();
            id
        }
    };
    // Changed before `since` (5000), paused then.
    let t1 = push("t1", 1000).await;
    c.reprioritise_transfer(t1, Some(Class::Urgent), None)
        .await
        .unwrap();
    stamp(&c, 2000).await;
    c.reprioritise_transfer(t1, None, Some(Some(0.3)))
        .await
        .unwrap();
    stamp(&c, 2500).await;
    c.pause_transfer(t1).await.unwrap();
    stamp(&c, 3000).await;
    c.resume_transfer(t1).await.unwrap();
    stamp(&c, 6000).await;
    // Published before `since`: gone.
    let t2 = push("t2", 1500).await;
    finished(&c, t2, 4000).await;
    // Cancelled before `since`: gone.
    let t3 = push("t3", 1600).await;
    c.cancel_transfer(t3, "x").await.unwrap();
    stamp(&c, 4500).await;
    finished(&c, t3, 4500).await;
    // Published after `since`: it was still moving then.
    let t4 = push("t4", 1700).await;
    finished(&c, t4, 7000).await;
    // Queued at `since` exactly: its own line.
    let t5 = push("t5", 5000).await;
    // Paused and resumed before `since`; its class changed at `since`.
    let t6 = push("t6", 1800).await;
    c.pause_transfer(t6).await.unwrap();
    stamp(&c, 1900).await;
    c.resume_transfer(t6).await.unwrap();
    stamp(&c, 1950).await;
    c.reprioritise_transfer(t6, Some(Class::Background), None)
        .await
        .unwrap();
    stamp(&c, 5000).await;

    let x = export(&c, 5000, &links).await;
    assert_eq!(x.left_out, 0);
    let arrive = |id, class, importance, bytes| What::Arrival {
        id,
        link: "l".into(),
        bytes,
        class,
        job: "j".into(),
        importance,
        deadline_ms: None,
    };
    let got: Vec<(i64, What)> = x
        .trace
        .events
        .iter()
        .map(|e| (e.at_ms, e.what.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (5000, arrive(t1, Class::Urgent, Some(0.3), 1100)),
            (5000, What::Pause { id: t1 }),
            (5000, arrive(t4, Class::Scheduled, None, 1800)),
            (5000, arrive(t6, Class::Scheduled, None, 1900)),
            (5000, arrive(t5, Class::Scheduled, None, 5100)),
            (
                5000,
                What::Class {
                    id: t6,
                    class: Class::Background
                }
            ),
            (6000, What::Resume { id: t1 }),
        ]
    );
    assert_eq!(x.trace.arrivals(), 4);
    // From the start, every transfer arrives once, as it was queued.
    let x = export(&c, 0, &links).await;
    assert_eq!(x.trace.arrivals(), 6);
    assert_eq!(
        x.trace.events[0].what,
        arrive(t1, Class::Scheduled, None, 1100)
    );
}
both!(export_queues_again_what_was_unfinished_at_since_as_it_was);

async fn export_fills_unknown_sizes_and_leaves_out_what_a_trace_cannot_hold(c: Catalog) {
    let links = [link("l", 1000, 20)];
    // Size unknown when queued: the size known at export time.
    let a = c
        .insert_transfer("l", "j", "/ck/a", "a", Class::Scheduled)
        .await
        .unwrap();
    let x = export(&c, 0, &links).await;
    assert!(matches!(
        x.trace.events[0].what,
        What::Arrival { bytes: 0, .. }
    ));
    c.note_transfer_progress(
        a,
        ProgressNote {
            bytes_total: 4096,
            bytes_done: 0,
            bytes_sent: 0,
        },
    )
    .await
    .unwrap();
    let x = export(&c, 0, &links).await;
    assert!(matches!(
        x.trace.events[0].what,
        What::Arrival { bytes: 4096, .. }
    ));
    // A size recorded with the arrival stays.
    let b = c
        .insert_transfer("l", "j", "/ck/b", "b", Class::Scheduled)
        .await
        .unwrap();
    let mut conn = c.pool.acquire().await.unwrap();
    sqlx::query(&c.db.sql("DELETE FROM events WHERE transfer = ?"))
        .bind(b.as_i64())
        .execute(&mut *conn)
        .await
        .unwrap();
    let known = arrival_with(b, "l", Class::Scheduled, None, Some(42));
    record(c.db, &mut conn, now_ms(), &known).await.unwrap();
    drop(conn);
    c.set_transfer_size(b, 9999, 1).await.unwrap();
    let x = export(&c, 0, &links).await;
    assert!(
        matches!(x.trace.events[1].what, What::Arrival { id, bytes: 42, .. } if id == b),
        "{:?}",
        x.trace.events
    );

    // A link the agent no longer has: its arrival, the transfer's changes
    // and its rate changes are left out, and counted.
    let g = c
        .insert_transfer("gone", "j", "/ck/g", "g", Class::Scheduled)
        .await
        .unwrap();
    c.pause_transfer(g).await.unwrap();
    c.record_link_rate("gone", 5000).await.unwrap();
    c.pause_transfer(a).await.unwrap();
    let x = export(&c, 0, &links).await;
    assert_eq!(x.left_out, 3);
    assert_eq!(x.trace.arrivals(), 2);
    assert!(matches!(x.trace.events.last().unwrap().what, What::Pause { id } if id == a));
    // A stored value no trace can carry is an error naming the column.
    sqlx::query(
        &c.db
            .sql("UPDATE events SET severity = 2.5 WHERE kind = 'arrival'"),
    )
    .execute(&c.pool)
    .await
    .unwrap();
    c.insert_signal("j", "nan", 0.5, None, None).await.unwrap();
    sqlx::query(
        &c.db
            .sql("UPDATE events SET severity = 2.5 WHERE kind = 'signal'"),
    )
    .execute(&c.pool)
    .await
    .unwrap();
    let e = c.export_trace(0, &links).await.unwrap_err().to_string();
    assert!(e.contains("severity") && e.contains("2.5"), "{e}");
}
both!(export_fills_unknown_sizes_and_leaves_out_what_a_trace_cannot_hold);

#[tokio::test]
async fn version_4_catalog_gets_the_history_it_kept() {
    let d = tempfile::tempdir().unwrap();
    let (data, pool) = catalog_at_version(
        d.path(),
        &[
            (
                "0001_catalog.sql",
                include_str!("../../../../migrations/sqlite/0001_catalog.sql"),
            ),
            (
                "0002_checkpoints.sql",
                include_str!("../../../../migrations/sqlite/0002_checkpoints.sql"),
            ),
            (
                "0003_scheduler.sql",
                include_str!("../../../../migrations/sqlite/0003_scheduler.sql"),
            ),
            (
                "0004_replica_files.sql",
                include_str!("../../../../migrations/sqlite/0004_replica_files.sql"),
            ),
        ],
    )
    .await;
    for q in [
        "INSERT INTO transfers (id, link, job, source_path, rel, class, state, created_at, \
         bytes_total, importance) VALUES (5, 'l', 'j', '/ck/s1', 's1', 'background', 'paused', \
         1000, 300, 0.25)",
        "INSERT INTO jobs (name, model_params, importance, origin, updated_at) \
         VALUES ('j', 7e9, 0.5, 'config', 900)",
        "INSERT INTO signals (job, kind, severity, received_at) VALUES ('j', 'nan', 0.75, 1200)",
    ] {
        sqlx::query(q).execute(&pool).await.unwrap();
    }
    pool.close().await;

    let c = Catalog::open(&data).await.unwrap();
    let got: Vec<(i64, Change)> = c
        .events_since(0)
        .await
        .unwrap()
        .into_iter()
        .map(|e| (e.at_ms, e.change))
        .collect();
    assert_eq!(
        got,
        [
            (
                900,
                Change::Job {
                    job: "j".into(),
                    model_params: Some(7e9),
                    importance: 0.5
                }
            ),
            (
                1000,
                arrival_with(TransferId(5), "l", Class::Background, Some(0.25), None)
            ),
            (
                1200,
                Change::Signal {
                    job: "j".into(),
                    kind: "nan".into(),
                    severity: 0.75
                }
            ),
        ]
    );
    let x = export(&c, 0, &[link("l", 1000, 20)]).await;
    assert_eq!(x.trace.arrivals(), 1);
    assert!(matches!(
        x.trace.events[1].what,
        What::Arrival { bytes: 300, .. }
    ));
}
