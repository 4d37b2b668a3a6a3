//! Deadlines on a simulated link: with nothing arriving, no signal and no
//! rate change after admission, every deadline the admission answer
//! called feasible is met (earliest-deadline-first while one is at
//! risk); an infeasible one is answered with the class that would meet
//! it, or the bytes over budget; and no class is starved below its
//! floor while deadlines are served.
#![allow(clippy::unwrap_used)]

use ferry_proto::state::TransferId;
use proptest::prelude::*;
use scheduler::replay::{self, End, Options};
use scheduler::trace::{Event, Header, LinkSpec, Trace, What, TRACE_VERSION};
use scheduler::{Class, Decision, LinkScheduler, Policy, Transfer};

const RATE: u64 = 80_000_000; // 10 MB/s
const RTT: u64 = 20;
const CHUNK: u64 = 1 << 20;

fn class() -> impl Strategy<Value = Class> {
    prop_oneof![
        Just(Class::Urgent),
        Just(Class::Scheduled),
        Just(Class::Background)
    ]
}

fn transfer(id: u64, class: Class, bytes: u64, importance: f64, deadline: Option<i64>) -> Transfer {
    Transfer {
        id: TransferId(id),
        class,
        job: format!("job-{}", id % 3),
        model_params: None,
        importance,
        bytes_left: bytes,
        created_ms: 0,
        size_final: true,
        deadline_ms: deadline,
    }
}

fn arrival(t: &Transfer) -> Event {
    Event {
        at_ms: 0,
        what: What::Arrival {
            id: t.id,
            link: "l".into(),
            bytes: t.bytes_left,
            class: t.class,
            job: t.job.clone(),
            importance: Some(t.importance),
            deadline_ms: t.deadline_ms,
        },
    }
}

fn trace(ts: &[Transfer], rtt_ms: u64) -> Trace {
    Trace {
        header: Header {
            ferry_trace: TRACE_VERSION,
            chunk_bytes: None,
            links: vec![LinkSpec {
                link: "l".into(),
                rate_bps: RATE,
                rtt_ms,
            }],
            jobs: vec![],
        },
        events: ts.iter().map(arrival).collect(),
    }
}

/// Queues the transfers of `ts` without a deadline, then answers those
/// with one, in order, each against everything queued before it: a
/// feasible one is queued, an infeasible one is left out (its client was
/// told). So nothing arrives after a deadline is admitted but
/// transfers whose admission said they endanger none. Returns the queue
/// and how many deadlines were admitted.
fn admit_all(policy: &Policy, ts: &[Transfer], rtt_ms: u64, chunk: u64) -> (Vec<Transfer>, usize) {
    let mut ls = LinkScheduler::new(policy.clone(), RATE, rtt_ms, 0);
    ls.set_chunk_bytes(chunk);
    let mut queued: Vec<Transfer> = ts
        .iter()
        .filter(|t| t.deadline_ms.is_none())
        .cloned()
        .collect();
    let mut admitted = 0;
    for t in ts.iter().filter(|t| t.deadline_ms.is_some()) {
        let a = ls.admission(t, &queued, &[], 0).unwrap();
        if a.feasible {
            admitted += 1;
            queued.push(t.clone());
        }
    }
    (queued, admitted)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn admitted_deadlines_are_met_when_nothing_arrives_after_admission(
        spec in prop::collection::vec(
            (class(), 1u64..40_000_000, 0.0f64..=1.0, prop::option::of(200i64..20_000)),
            1..14,
        ),
        max_active in 1usize..5,
        rtt in 1u64..200,
        chunk in 64_000u64..8_000_000,
    ) {
        let policy = Policy { max_active, ..Policy::default() };
        let ts: Vec<Transfer> = spec
            .iter()
            .enumerate()
            .map(|(i, &(c, b, imp, d))| transfer(i as u64 + 1, c, b, imp, d))
            .collect();
        let (queued, admitted) = admit_all(&policy, &ts, rtt, chunk);
        let r = replay::run(&trace(&queued, rtt), &policy, &Options { chunk_bytes: chunk });
        for (o, t) in r.outcomes.iter().zip(&queued) {
            prop_assert_eq!(o.end, End::Ready);
            if let Some(d) = t.deadline_ms {
                let ready = o.ready_ms.unwrap();
                prop_assert!(ready <= d, "transfer {} ({:?}, {} bytes) ready at {} ms, deadline {} ms; queue {:?}",
                    t.id.0, t.class, t.bytes_left, ready, d, queued);
            }
        }
        prop_assert!(admitted <= queued.len());
    }

    #[test]
    fn an_infeasible_deadline_names_the_class_that_would_meet_it_or_the_bytes_over(
        spec in prop::collection::vec((class(), 1u64..40_000_000, 0.0f64..=1.0), 0..10),
        c in class(),
        bytes in 1u64..80_000_000,
        deadline in 100i64..10_000,
    ) {
        let policy = Policy::default();
        let mut ls = LinkScheduler::new(policy, RATE, RTT, 0);
        ls.set_chunk_bytes(CHUNK);
        let queued: Vec<Transfer> = spec
            .iter()
            .enumerate()
            .map(|(i, &(c, b, imp))| transfer(i as u64 + 2, c, b, imp, None))
            .collect();
        let cand = transfer(1, c, bytes, 0.5, Some(deadline));
        let a = ls.admission(&cand, &queued, &[], 0).unwrap();
        prop_assert_eq!(a.deadline_ms, deadline);
        // Alone at the full rate it cannot be sooner than its bytes take.
        prop_assert!(a.eta_ms as f64 >= bytes as f64 / (RATE as f64 / 8000.0) - 1.0);
        let in_time = a.eta_ms + a.margin_ms <= deadline;
        prop_assert_eq!(a.feasible, in_time, "no deadline among the others: {:?}", a);
        if in_time {
            prop_assert!(a.class_needed.is_none() && a.bytes_over.is_none());
        } else if let Some(better) = a.class_needed {
            prop_assert!(better < c);
            let b = ls.admission(&Transfer { class: better, ..cand.clone() }, &queued, &[], 0).unwrap();
            prop_assert!(b.feasible, "{:?} in {:?}", b, better);
            prop_assert!(a.bytes_over.is_none());
        } else {
            prop_assert!(a.bytes_over.unwrap() > 0);
            let u = ls.admission(&Transfer { class: Class::Urgent, ..cand.clone() }, &queued, &[], 0).unwrap();
            prop_assert!(!u.feasible);
        }
    }

    #[test]
    fn no_class_is_starved_below_its_floor_while_deadlines_are_served(
        spec in prop::collection::vec((class(), 20_000_000u64..60_000_000, prop::option::of(100i64..3_000)), 3..12),
    ) {
        let policy = Policy { max_active: 64, ..Policy::default() };
        let mut ls = LinkScheduler::new(policy.clone(), RATE, RTT, 0);
        ls.set_chunk_bytes(CHUNK);
        // One transfer of each class at least, the rest as generated.
        let mut ts: Vec<Transfer> = [Class::Urgent, Class::Scheduled, Class::Background]
            .iter()
            .enumerate()
            .map(|(i, &c)| transfer(i as u64 + 1, c, 50_000_000, 0.5, Some(500)))
            .collect();
        for (i, &(c, b, d)) in spec.iter().enumerate() {
            ts.push(transfer(i as u64 + 4, c, b, 0.5, d));
        }
        for t in &ts {
            ls.upsert(t.clone(), 0);
        }
        let mut left: Vec<(TransferId, Class, u64)> = ts.iter().map(|t| (t.id, t.class, t.bytes_left)).collect();
        let mut queued: Vec<u64> = vec![0; ts.len() + 4];
        let mut sent = [0u64; 3];
        let mut now = 0i64;
        let busy = |left: &[(TransferId, Class, u64)], c: Class| left.iter().any(|l| l.1 == c && l.2 > 0);
        // Until a class runs out, every class has chunks ready.
        while [Class::Urgent, Class::Scheduled, Class::Background].iter().all(|c| busy(&left, *c)) {
            for l in &left {
                let q = &mut queued[l.0 .0 as usize];
                while *q < 2 * CHUNK && *q < l.2 {
                    ls.chunk_ready(l.0, CHUNK.min(l.2 - *q));
                    *q += CHUNK.min(l.2 - *q);
                }
            }
            match ls.next(now) {
                Decision::Send { id, bytes, .. } => {
                    let l = left.iter_mut().find(|l| l.0 == id).unwrap();
                    l.2 -= bytes;
                    queued[id.0 as usize] -= bytes;
                    let ci = match l.1 { Class::Urgent => 0, Class::Scheduled => 1, Class::Background => 2 };
                    sent[ci] += bytes;
                }
                Decision::Wait { until_ms } => now = until_ms,
                Decision::Idle => prop_assert!(false, "idle with chunks ready"),
            }
        }
        let total: u64 = sent.iter().sum();
        // Within a few chunks of each floor.
        let slack = 4 * CHUNK;
        prop_assert!(sent[1] + slack >= (policy.floors.scheduled * total as f64) as u64, "{:?}", sent);
        prop_assert!(sent[2] + slack >= (policy.floors.background * total as f64) as u64, "{:?}", sent);
    }
}

/// With deadline-first off (the baseline), a far deadline does not take
/// the class from a higher-scored transfer; with it on, an at-risk
/// deadline does.
#[test]
fn an_at_risk_deadline_is_served_first_only_with_deadline_first() {
    for on in [true, false] {
        let policy = Policy {
            deadline_first: on,
            ..Policy::default()
        };
        let mut ls = LinkScheduler::new(policy, RATE, RTT, 0);
        ls.set_chunk_bytes(CHUNK);
        // 2 is more important; 1 has 10 MB due in 1.5 s at 10 MB/s.
        ls.upsert(
            transfer(1, Class::Scheduled, 10_000_000, 0.0, Some(1_500)),
            0,
        );
        ls.upsert(transfer(2, Class::Scheduled, 10_000_000, 1.0, None), 0);
        for id in [1, 2] {
            for _ in 0..10 {
                ls.chunk_ready(TransferId(id), CHUNK);
            }
        }
        let mut first = Vec::new();
        let mut now = 0;
        while first.len() < 6 {
            match ls.next(now) {
                Decision::Send { id, .. } => first.push(id.0),
                Decision::Wait { until_ms } => now = until_ms,
                Decision::Idle => break,
            }
        }
        let ones = first.iter().filter(|&&i| i == 1).count();
        if on {
            assert_eq!(ones, 6, "{first:?}");
        } else {
            assert!(ones < 6, "{first:?}");
        }
    }
}

/// The margin adds the time the sink takes from the last byte to the
/// publish, so a deadline that leaves room for the bytes but not for the
/// sink's verification and publish is answered infeasible.
#[test]
fn the_sinks_finish_time_is_in_the_margin() {
    let mut ls = LinkScheduler::new(Policy::default(), RATE, RTT, 0);
    ls.set_chunk_bytes(CHUNK);
    let busy = [false, true, false];
    let base = ls.deadline_margin_ms(Class::Scheduled, busy);
    // 10 MB at 10 MB/s: ready at 1 s, plus the margin; due 1 s later.
    let cand = transfer(1, Class::Scheduled, 10_000_000, 0.0, Some(2_000 + base));
    let a = ls.admission(&cand, &[], &[], 0).unwrap();
    assert!(a.feasible, "{a:?}");
    ls.set_finish_ms(1_500);
    assert_eq!(ls.finish_ms(), 1_500);
    assert_eq!(ls.deadline_margin_ms(Class::Scheduled, busy), base + 1_500);
    let a = ls.admission(&cand, &[], &[], 0).unwrap();
    assert!(!a.feasible && a.margin_ms == base + 1_500, "{a:?}");
    ls.set_finish_ms(-5);
    assert_eq!(ls.finish_ms(), 0, "a negative time counts as 0");
}
