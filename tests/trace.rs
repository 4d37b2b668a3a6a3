//! The recorded scheduling history of a real source agent (`ferry
//! serve`): operator and controller actions through the API and the CLI,
//! then `GET /v1/trace` and `ferry trace` must hold each of them as it
//! happened, in the trace format `ferry replay` reads, and the trace
//! replays with the same transfers.

#![allow(clippy::unwrap_used)]

// Shared with tests/e2e.rs, which uses the rest of it.
#[allow(dead_code)]
mod common;

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use ferry_proto::state::TransferId;
use scheduler::trace::{JobSpec, LinkSpec, Trace, What};
use scheduler::Class;
use serde_json::{json, Value};

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// What the test did and when: the local clock before and after the
/// request (the agent runs on the same host, so the event's `at_ms` lies
/// between).
#[derive(Debug)]
struct Done {
    what: What,
    from_ms: i64,
    to_ms: i64,
}

/// `METHOD url` with a JSON body; the status and the JSON answer, and the
/// clock before and after.
async fn send(w: &World, method: &str, url: &str, body: Value) -> (u16, Value, i64, i64) {
    let from = now_ms();
    let r = w
        .http()
        .request(method.parse().unwrap(), url)
        .json(&body)
        .send()
        .await
        .unwrap_or_else(|e| w.fail(format!("{method} {url}: {e}")));
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    (status, v, from, now_ms())
}

/// `GET /v1/trace[?since=]`: the body, checked to come as JSON lines.
async fn get_trace(w: &World, source: &Agent, since: Option<i64>) -> String {
    let mut url = format!("{}/v1/trace", source.url());
    if let Some(s) = since {
        url += &format!("?since={s}");
    }
    let r = w.http().get(&url).send().await.unwrap();
    let status = r.status();
    let ct = r
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .map(|c| c.to_str().unwrap().to_string());
    let body = r.text().await.unwrap();
    w.ensure(status.is_success(), || {
        format!("GET {url}: {status}: {body}")
    });
    w.ensure(ct.as_deref() == Some("application/x-ndjson"), || {
        format!("GET {url}: content type {ct:?}")
    });
    body
}

fn id(v: &Value) -> TransferId {
    TransferId::from_i64(v["id"].as_i64().unwrap()).unwrap()
}

#[tokio::test]
async fn a_real_agent_s_trace_holds_each_change_as_it_happened() {
    let w = World::new("trace").await;
    let root = w.source_root();
    let (bg1, bg2, ckpt) = (
        root.join("logs-a"),
        root.join("logs-b"),
        root.join("step_000100"),
    );
    for (dir, size) in [(&bg1, "4MB"), (&bg2, "4MB"), (&ckpt, "2MB")] {
        w.gen(dir, size).await;
    }
    // The source's link starts at 8 Mbit/s behind a faster emulated WAN,
    // so every transfer is still moving while it is changed, and raising
    // the cap later lets them finish quickly.
    let c = w
        .start_cluster("200Mbit/s", &[], |_, src| {
            src.links[0].rate = "8Mbit/s".into();
        })
        .await;
    let api = |path: &str| format!("{}{path}", c.source.url());
    let mut done: Vec<Done> = Vec::new();
    let t0 = now_ms();

    // Two background copies and a push.
    let mut bg = Vec::new();
    for dir in [&bg1, &bg2] {
        let body = json!({ "path": dir, "class": "background" });
        let (s, v, from_ms, to_ms) = send(&w, "POST", &api("/v1/transfers"), body).await;
        w.ensure(s == 201, || format!("POST /v1/transfers: {s} {v}"));
        bg.push(id(&v));
        done.push(Done {
            what: What::Arrival {
                id: id(&v),
                link: LINK.into(),
                bytes: tree_bytes(dir),
                class: Class::Background,
                job: JOB.into(),
                importance: None,
                deadline_ms: None,
            },
            from_ms,
            to_ms,
        });
    }
    let from_ms = now_ms();
    let pushed = TransferId::from_i64(w.push_no_wait(&c.source, &ckpt).await).unwrap();
    done.push(Done {
        what: What::Arrival {
            id: pushed,
            link: LINK.into(),
            bytes: tree_bytes(&ckpt),
            class: Class::Scheduled,
            job: JOB.into(),
            importance: None,
            deadline_ms: None,
        },
        from_ms,
        to_ms: now_ms(),
    });

    // A loss spike: it promotes the push to urgent, which is not a class
    // change of the trace (a replay derives it from the signal).
    let body = json!({ "job": JOB, "kind": "loss_spike", "severity": 0.8 });
    let (s, v, from_ms, to_ms) = send(&w, "POST", &api("/v1/signals"), body).await;
    w.ensure(s == 201 && v["promoted"] == pushed.as_i64(), || {
        format!("POST /v1/signals: {s} {v}")
    });
    done.push(Done {
        what: What::Signal {
            job: JOB.into(),
            severity: 0.8,
            kind: Some("loss_spike".into()),
        },
        from_ms,
        to_ms,
    });

    // An operator: a class, an importance, a pause and a resume.
    let steps = [
        (
            "PATCH",
            format!("/v1/transfers/{}", bg[0]),
            json!({ "class": "scheduled" }),
            What::Class {
                id: bg[0],
                class: Class::Scheduled,
            },
        ),
        (
            "PATCH",
            format!("/v1/transfers/{}", bg[1]),
            json!({ "importance": 0.9 }),
            What::Importance {
                id: bg[1],
                importance: Some(0.9),
            },
        ),
        (
            "POST",
            format!("/v1/transfers/{}/pause", bg[1]),
            json!({}),
            What::Pause { id: bg[1] },
        ),
        (
            "POST",
            format!("/v1/transfers/{}/resume", bg[1]),
            json!({}),
            What::Resume { id: bg[1] },
        ),
        (
            "PUT",
            format!("/v1/links/{LINK}"),
            json!({ "rate_bps": 200_000_000u64 }),
            What::Rate {
                link: LINK.into(),
                rate_bps: 200_000_000,
            },
        ),
        (
            "PUT",
            format!("/v1/jobs/{JOB}"),
            json!({ "model_params": 7e9, "importance": 0.7 }),
            What::Job(JobSpec {
                job: JOB.into(),
                model_params: Some(7e9),
                importance: 0.7,
            }),
        ),
    ];
    let progress =
        async |t: TransferId| w.transfer(&c.source, t.as_i64()).await["progress"].clone();
    for (method, path, body, what) in steps {
        match what {
            // Paused once it moves (its run has opened it at the sink),
            // resumed once that run has stopped, as an operator would.
            // A pause and resume a few milliseconds apart while the
            // transfer's first open is still on its way can leave it in
            // `verifying` for good (a data-path race this test is not
            // about; see the report of this change).
            What::Pause { id } => {
                w.wait_until(
                    "the background copy to move",
                    Duration::from_secs(60),
                    async || match progress(id).await["bytes_sent"].as_u64() {
                        Some(n) if n > 0 => Ok(()),
                        other => Err(format!("bytes_sent {other:?}")),
                    },
                )
                .await;
            }
            What::Resume { id } => {
                w.wait_until(
                    "the paused copy's run to stop",
                    Duration::from_secs(60),
                    async || match progress(id).await {
                        Value::Null => Ok(()),
                        p => Err(format!("still running: {p}")),
                    },
                )
                .await;
            }
            _ => {}
        }
        let (s, v, from_ms, to_ms) = send(&w, method, &api(&path), body).await;
        w.ensure(s == 200, || {
            format!("{method} {path}: {s} {v} (did the transfer finish too early?)")
        });
        done.push(Done {
            what,
            from_ms,
            to_ms,
        });
    }

    // Everything is published, so each arrival's size is final.
    for t in bg.iter().chain([&pushed]) {
        w.wait_until(
            &format!("transfer {t} to be published"),
            Duration::from_secs(120),
            async || {
                let v = w.transfer(&c.source, t.as_i64()).await;
                match common::s(&v, "state") {
                    "published" => Ok(()),
                    other => Err(format!("{other}: {v}")),
                }
            },
        )
        .await;
    }

    let body = get_trace(&w, &c.source, None).await;
    let t = Trace::parse(&body).unwrap_or_else(|e| w.fail(format!("{e}\n{body}")));
    assert_eq!(t.header.ferry_trace, 1);
    assert_eq!(
        t.header.links,
        [LinkSpec {
            link: LINK.into(),
            rate_bps: 8_000_000,
            rtt_ms: 20,
        }],
        "from the start: the configured rate cap and RTT hint"
    );
    assert!(t.header.jobs.is_empty(), "{:?}", t.header.jobs);
    // The agent's start recorded its configured rate cap, before all else.
    let first = &t.events[0];
    assert_eq!(
        first.what,
        What::Rate {
            link: LINK.into(),
            rate_bps: 8_000_000
        }
    );
    assert!(first.at_ms <= t0, "{first:?} is after the agent started");
    let rest = &t.events[1..];
    let got: Vec<&What> = rest.iter().map(|e| &e.what).collect();
    let want: Vec<&What> = done.iter().map(|d| &d.what).collect();
    assert_eq!(got, want, "the trace:\n{body}");
    for (e, d) in rest.iter().zip(&done) {
        assert!(
            (d.from_ms..=d.to_ms).contains(&e.at_ms),
            "{:?} at {} was done between {} and {}",
            e.what,
            e.at_ms,
            d.from_ms,
            d.to_ms
        );
    }
    let transfers = w.transfers(&c.source).await;
    assert_eq!(t.arrivals(), 3);
    assert_eq!(t.arrivals(), transfers.len(), "{transfers:?}");

    // From just after the signal: the transfers moving then arrive again
    // at that time, as they were then (the class and importance changes
    // came later and follow as lines).
    let mid = rest[3].at_ms + 1;
    let body = get_trace(&w, &c.source, Some(mid)).await;
    let t_mid = Trace::parse(&body).unwrap_or_else(|e| w.fail(format!("{e}\n{body}")));
    assert_eq!(t_mid.header.links[0].rate_bps, 8_000_000);
    let moving: Vec<TransferId> = bg
        .iter()
        .chain([&pushed])
        .copied()
        .filter(|t| {
            let row = transfers.iter().find(|r| r["id"] == t.as_i64()).unwrap();
            row["finished_at"].as_i64().unwrap() >= mid
        })
        .collect();
    assert_eq!(moving.len(), 3, "the rate change came later: {transfers:?}");
    let requeued: Vec<&What> = t_mid.events[..3].iter().map(|e| &e.what).collect();
    assert_eq!(requeued, want[..3], "as they were at {mid}:\n{body}");
    assert!(t_mid.events[..3].iter().all(|e| e.at_ms == mid));
    let lines: Vec<&What> = t_mid.events[3..].iter().map(|e| &e.what).collect();
    assert_eq!(lines, want[4..]);

    // From now: the header holds what is in force, nothing is queued.
    let later = Trace::parse(&get_trace(&w, &c.source, Some(now_ms() + 1)).await).unwrap();
    assert_eq!(later.header.links[0].rate_bps, 200_000_000);
    assert_eq!(
        later.header.jobs,
        [JobSpec {
            job: JOB.into(),
            model_params: Some(7e9),
            importance: 0.7,
        }]
    );
    assert!(later.events.is_empty(), "{:?}", later.events);

    // `ferry trace` writes the same trace to a file; a bad --since is
    // named.
    let file = w.root.join("recorded.trace");
    let url = c.source.url();
    let out = w
        .ferry(
            &[
                "trace",
                "--since",
                "1h",
                "-o",
                file.to_str().unwrap(),
                "--server",
                &url,
            ],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(out.success(), || format!("ferry trace failed: {out}"));
    w.ensure(
        out.stderr.contains("ferry replay") && out.stderr.contains("3 transfers"),
        || format!("ferry trace should say what it wrote: {out}"),
    );
    let from_file = Trace::parse(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(from_file, t);

    // The recorded trace replays: every transfer is published in the
    // simulation too, the push counted as urgent (the replay promotes it
    // from the signal, as the agent did), the first copy in the class the
    // operator gave it.
    let policy = scheduler::Policy::default();
    let report = scheduler::replay::run(&t, &policy, &scheduler::replay::Options::default());
    let fates: Vec<(TransferId, Class, scheduler::replay::End, u64)> = report
        .outcomes
        .iter()
        .map(|o| (o.id, o.group, o.end, o.bytes))
        .collect();
    let ready = scheduler::replay::End::Ready;
    assert_eq!(
        fates,
        [
            (bg[0], Class::Scheduled, ready, tree_bytes(&bg1)),
            (bg[1], Class::Background, ready, tree_bytes(&bg2)),
            (pushed, Class::Urgent, ready, tree_bytes(&ckpt)),
        ]
    );
    assert_eq!(report.outcomes.len(), transfers.len());
    let mid_report =
        scheduler::replay::run(&t_mid, &policy, &scheduler::replay::Options::default());
    assert_eq!(mid_report.outcomes.len(), 3);
    // And so does the file, through `ferry replay` as an operator runs it.
    let out = w
        .ferry(
            &["replay", file.to_str().unwrap(), "--json"],
            &[],
            Duration::from_secs(60),
        )
        .await;
    w.ensure(out.success(), || format!("ferry replay failed: {out}"));
    let v: Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| w.fail(format!("ferry replay --json: {e}: {out}")));
    assert_eq!(v["transfers"], 3, "{v}");
    assert_eq!(v["signals"], 1, "{v}");
    let out = w
        .ferry(
            &["trace", "--since", "last tuesday", "--server", &url],
            &[],
            Duration::from_secs(30),
        )
        .await;
    w.ensure(
        !out.success() && out.stderr.contains("--since") && out.stderr.contains("24h"),
        || format!("a bad --since should be named: {out}"),
    );
    assert!(Path::new(&file).is_file());
}
