//! The pool's shared settings: seeded only when absent, changed through
//! the API with their writer, jobs seeded without overwriting, on both
//! dialects; changes and signals announced on PostgreSQL only.

use std::time::Duration;

use serde_json::json;

use super::*;
use crate::settings::payload;

async fn settings_are_seeded_only_when_absent(c: Catalog) {
    let first = c
        .seed_settings(
            &[
                ("scheduler.max_active".into(), json!(4)),
                ("link.l.rate".into(), json!(1_000_000_000u64)),
            ],
            "config of a",
        )
        .await
        .unwrap();
    assert_eq!(first.len(), 2);
    // A second agent's config: the stored values win, a new name is added.
    let second = c
        .seed_settings(
            &[
                ("scheduler.max_active".into(), json!(7)),
                ("scheduler.aging".into(), json!("5m")),
            ],
            "config of b",
        )
        .await
        .unwrap();
    let got: Vec<(String, serde_json::Value, String)> = second
        .iter()
        .map(|s| (s.name.clone(), s.value.clone(), s.updated_by.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (
                "link.l.rate".into(),
                json!(1_000_000_000u64),
                "config of a".into()
            ),
            ("scheduler.aging".into(), json!("5m"), "config of b".into()),
            (
                "scheduler.max_active".into(),
                json!(4),
                "config of a".into()
            ),
        ]
    );
    // The API replaces a value and records who did.
    let put = c
        .put_setting("scheduler.max_active", &json!(8), "alice")
        .await
        .unwrap();
    assert_eq!(
        (put.value.clone(), put.updated_by.as_str()),
        (json!(8), "alice")
    );
    let after = c
        .seed_settings(&[("scheduler.max_active".into(), json!(4))], "config of a")
        .await
        .unwrap();
    let m = after
        .iter()
        .find(|s| s.name == "scheduler.max_active")
        .unwrap();
    assert_eq!(m, &put);
    // A bad name is refused, naming it; nothing of the batch is written.
    let e = c
        .seed_settings(
            &[("ok".into(), json!(1)), ("bad name".into(), json!(1))],
            "x",
        )
        .await
        .unwrap_err();
    assert!(e.to_string().contains("\"bad name\""), "{e}");
    assert!(c.settings().await.unwrap().iter().all(|s| s.name != "ok"));
    // What an agent reads every second: the same settings, and the
    // signals since a time.
    let (sig, _) = c.insert_signal("j", "nan", 0.5, None, None).await.unwrap();
    let (settings, signals) = c.shared_state(sig.received_at).await.unwrap();
    assert_eq!(settings, c.settings().await.unwrap());
    assert_eq!(signals, std::slice::from_ref(&sig));
    let (_, later) = c.shared_state(sig.received_at + 1).await.unwrap();
    assert!(later.is_empty(), "{later:?}");
}
both!(settings_are_seeded_only_when_absent);

async fn config_jobs_are_seeded_only_when_absent(c: Catalog) {
    let held = c
        .seed_config_jobs(&[("a".into(), Some(7e10), 0.8)])
        .await
        .unwrap();
    assert_eq!(
        (
            held[0].model_params,
            held[0].importance,
            held[0].origin.as_str()
        ),
        (Some(7e10), 0.8, origin::CONFIG)
    );
    let api = c.put_job("b", None, 0.9).await.unwrap();
    // Another agent's config: neither the config row nor the API row
    // changes (unlike `sync_config_jobs`, where a config row follows the
    // file); a new job is added.
    let held = c
        .seed_config_jobs(&[
            ("a".into(), Some(1e9), 0.1),
            ("b".into(), None, 0.2),
            ("c".into(), None, 0.3),
        ])
        .await
        .unwrap();
    let got: Vec<(&str, f64)> = held
        .iter()
        .map(|j| (j.name.as_str(), j.importance))
        .collect();
    assert_eq!(got, [("a", 0.8), ("b", 0.9), ("c", 0.3)]);
    assert_eq!(c.job("b").await.unwrap().unwrap(), api);
    // One `job` event per job added, none for the jobs kept.
    let jobs: Vec<String> = c
        .events_since(i64::MIN)
        .await
        .unwrap()
        .into_iter()
        .filter_map(|e| match e.change {
            Change::Job { job, .. } => Some(job),
            _ => None,
        })
        .collect();
    assert_eq!(jobs, ["a", "b", "c"]);
    let e = c
        .seed_config_jobs(&[("d".into(), None, 1.5)])
        .await
        .unwrap_err();
    assert!(e.to_string().contains("\"d\" importance"), "{e}");
    assert_eq!(c.job("d").await.unwrap(), None);
}
both!(config_jobs_are_seeded_only_when_absent);

/// A single agent's catalog has nobody to tell: no listener.
#[tokio::test]
async fn sqlite_has_no_pool_to_listen_to() {
    let t = TestCatalog::new(Dialect::Sqlite).await;
    assert!(t
        .catalog
        .listen_pool(Duration::from_secs(5))
        .await
        .unwrap()
        .is_none());
    t.finish().await;
}

/// Every change of a setting or a job, and every new signal, is
/// announced to the pool's listeners once its transaction commits; a
/// repeated signal (same key) is not.
#[tokio::test]
async fn changes_and_signals_are_announced_on_postgres() {
    let t = TestCatalog::new(Dialect::Postgres).await;
    let c = &t.catalog;
    let mut l = c
        .listen_pool(Duration::from_secs(10))
        .await
        .unwrap()
        .unwrap();
    let next = async |l: &mut PoolListener| {
        tokio::time::timeout(Duration::from_secs(10), l.recv())
            .await
            .expect("a notification within 10 s")
            .unwrap()
    };
    c.put_setting("scheduler.max_active", &json!(5), "alice")
        .await
        .unwrap();
    assert_eq!(next(&mut l).await.as_deref(), Some(payload::SETTINGS));
    c.put_job("j", None, 0.5).await.unwrap();
    assert_eq!(next(&mut l).await.as_deref(), Some(payload::SETTINGS));
    c.insert_signal("j", "nan", 0.5, None, Some("k1"))
        .await
        .unwrap();
    assert_eq!(next(&mut l).await.as_deref(), Some(payload::SIGNAL));
    // Seeding what is stored already changes nothing: no announcement;
    // the repeated signal neither. The next one heard is the new job's.
    c.seed_settings(&[("scheduler.max_active".into(), json!(4))], "config of b")
        .await
        .unwrap();
    c.insert_signal("j", "nan", 0.5, None, Some("k1"))
        .await
        .unwrap();
    c.seed_config_jobs(&[("new".into(), None, 0.1)])
        .await
        .unwrap();
    assert_eq!(next(&mut l).await.as_deref(), Some(payload::SETTINGS));
    drop(l);
    t.finish().await;
}

/// A checked write sees every stored setting with its own value in
/// place, and writes nothing when the check refuses. On PostgreSQL two
/// checked writes at once, each valid alone but not together, never
/// both land: the lock makes the second see the first.
#[tokio::test]
async fn checked_writes_valid_alone_but_not_together_do_not_both_land() {
    let t = TestCatalog::new(Dialect::Postgres).await;
    let c = t.catalog.clone();
    // The check: the two floors must sum to at most 0.9.
    let sum_ok = |all: &[Setting]| {
        let f = |n: &str| {
            all.iter()
                .find(|s| s.name == n)
                .and_then(|s| s.value.as_f64())
                .unwrap_or(0.0)
        };
        let sum = f("scheduler.floors.scheduled") + f("scheduler.floors.background");
        if sum <= 0.9 {
            Ok(())
        } else {
            Err(format!("floors sum to {sum}"))
        }
    };
    let e = c
        .put_setting_checked("scheduler.floors.scheduled", &json!(0.95), "alice", sum_ok)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("floors sum to 0.95"), "{e}");
    assert!(c.settings().await.unwrap().is_empty());
    for _ in 0..10 {
        for n in ["scheduler.floors.scheduled", "scheduler.floors.background"] {
            c.put_setting(n, &json!(0.0), "reset").await.unwrap();
        }
        let (half, most) = (json!(0.5), json!(0.45));
        let (a, b) = tokio::join!(
            c.put_setting_checked("scheduler.floors.scheduled", &half, "a", sum_ok),
            c.put_setting_checked("scheduler.floors.background", &most, "b", sum_ok),
        );
        assert_eq!(
            [a.is_ok(), b.is_ok()].iter().filter(|x| **x).count(),
            1,
            "{a:?} {b:?}"
        );
        assert_eq!(sum_ok(&c.settings().await.unwrap()), Ok(()));
    }
    t.finish().await;
}
