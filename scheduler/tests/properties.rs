//! Property tests of the link scheduler: shares by score, pre-emption at
#![allow(clippy::unwrap_used)]
//! the next decision, class floors, bounded waits and the rate cap.

use std::collections::HashMap;

use ferry_proto::state::TransferId;
use proptest::prelude::*;
use scheduler::{Class, Decision, Floors, LinkScheduler, Policy, PolicyKind, Transfer, Weights};

const MIB: u64 = 1 << 20;
/// A rate no test reaches (bit/s), for properties that are not about it.
const FAST: u64 = 1 << 50;

fn transfer(id: u64, class: Class, importance: f64, params: Option<f64>) -> Transfer {
    Transfer {
        id: TransferId(id),
        class,
        job: format!("job-{id}"),
        model_params: params,
        importance,
        bytes_left: u64::MAX / 4,
        created_ms: 0,
        size_final: false,
        deadline_ms: None,
    }
}

/// Keeps every listed transfer ready (one chunk queued) and runs
/// `decisions` decisions, one ms apart; returns the bytes each got and
/// the order of sends.
fn run(
    s: &mut LinkScheduler,
    ids: &[u64],
    sizes: &[u64],
    decisions: usize,
    now: &mut i64,
) -> (std::collections::HashMap<u64, u64>, Vec<u64>) {
    let mut got = std::collections::HashMap::new();
    let mut order = Vec::new();
    let mut k = 0usize;
    for &id in ids {
        s.chunk_ready(TransferId(id), sizes[k % sizes.len()]);
        k += 1;
    }
    for _ in 0..decisions {
        *now += 1;
        match s.next(*now) {
            Decision::Send { id, bytes, .. } => {
                let id = id.0;
                *got.entry(id).or_insert(0) += bytes;
                order.push(id);
                s.chunk_ready(TransferId(id), sizes[k % sizes.len()]);
                k += 1;
            }
            Decision::Wait { until_ms } => *now = until_ms - 1,
            Decision::Idle => panic!("idle with ready chunks"),
        }
    }
    (got, order)
}

fn chunk_sizes() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(64 * 1024..=4 * MIB, 1..16)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Within one class, bytes follow scores.
    #[test]
    fn shares_within_a_class_follow_scores(
        jobs in prop::collection::vec((0.0f64..=1.0, prop::option::of(1e8f64..1e12)), 2..6),
        sizes in chunk_sizes(),
    ) {
        let mut s = LinkScheduler::new(Policy::default(), FAST, 100, 0);
        let ids: Vec<u64> = (1..=jobs.len() as u64).collect();
        for (&id, &(imp, p)) in ids.iter().zip(&jobs) {
            s.upsert(transfer(id, Class::Scheduled, imp, p), 0);
        }
        let mut now = 0;
        let (got, _) = run(&mut s, &ids, &sizes, 6000, &mut now);
        let shares = s.shares();
        let total: u64 = got.values().sum();
        for (id, want) in shares {
            let have = *got.get(&id.0).unwrap_or(&0) as f64 / total as f64;
            prop_assert!((have - want).abs() < 0.01, "transfer {id}: share {have:.4}, score says {want:.4}");
        }
    }

    /// A new urgent transfer is served at the very next decision, whatever
    /// the lower classes did before; then it gets what the floors leave.
    #[test]
    fn urgent_arrival_preempts_at_the_next_decision(
        lower in prop::collection::vec((prop::bool::ANY, 0.0f64..=1.0), 1..5),
        before in 0usize..300,
        sizes in chunk_sizes(),
    ) {
        let mut s = LinkScheduler::new(Policy::default(), FAST, 100, 0);
        let ids: Vec<u64> = (1..=lower.len() as u64).collect();
        for (&id, &(bg, imp)) in ids.iter().zip(&lower) {
            let class = if bg { Class::Background } else { Class::Scheduled };
            s.upsert(transfer(id, class, imp, None), 0);
        }
        let mut now = 0;
        let (_, _) = run(&mut s, &ids, &sizes, before, &mut now);
        let urgent = 100;
        s.upsert(transfer(urgent, Class::Urgent, 0.0, None), now);
        s.chunk_ready(TransferId(urgent), sizes[0]);
        now += 1;
        let d = s.next(now);
        prop_assert!(matches!(d, Decision::Send { id, priority: 2, .. } if id == TransferId(urgent)), "{d:?}");
        // Keep it ready: over many decisions it gets 1 - floors of the
        // busy lower classes.
        let (got, _) = run(&mut s, &[urgent], &sizes, 4000, &mut now);
        let total: u64 = got.values().sum();
        let f = Policy::default().floors;
        let sched = lower.iter().any(|l| !l.0);
        let bg = lower.iter().any(|l| l.0);
        let want = 1.0 - if sched { f.scheduled } else { 0.0 } - if bg { f.background } else { 0.0 };
        let have = got[&urgent] as f64 / total as f64;
        prop_assert!((have - want).abs() < 0.02, "urgent got {have:.3}, floors leave {want:.3}");
    }

    /// With non-zero floors no class starves: each class gets its weight,
    /// and no ready transfer waits more than a bounded number of
    /// decisions between two of its chunks.
    #[test]
    fn floors_hold_and_no_ready_transfer_starves(
        fs in 0.01f64..0.3, fb in 0.01f64..0.3,
        per_class in prop::collection::vec(1usize..3, 3),
        sizes in chunk_sizes(),
    ) {
        let policy = Policy { floors: Floors { scheduled: fs, background: fb }, ..Policy::default() };
        let mut s = LinkScheduler::new(policy, FAST, 100, 0);
        let classes = [Class::Urgent, Class::Scheduled, Class::Background];
        let mut ids = Vec::new();
        let mut class_of = std::collections::HashMap::new();
        for (c, &n) in classes.iter().zip(&per_class) {
            for _ in 0..n {
                let id = ids.len() as u64 + 1;
                s.upsert(transfer(id, *c, 0.5, None), 0);
                class_of.insert(id, *c);
                ids.push(id);
            }
        }
        let mut now = 0;
        let (got, order) = run(&mut s, &ids, &sizes, 8000, &mut now);
        let total: u64 = got.values().sum();
        let weight = |c: Class| match c { Class::Urgent => 1.0 - fs - fb, Class::Scheduled => fs, Class::Background => fb };
        for c in classes {
            let have: u64 = got.iter().filter(|(id, _)| class_of[*id] == c).map(|(_, b)| *b).sum();
            let have = have as f64 / total as f64;
            prop_assert!((have - weight(c)).abs() < 0.02, "{c}: {have:.3} vs weight {:.3}", weight(c));
        }
        // Bound on the gap, from start-time fair queuing at two levels:
        // while i waits one chunk, another flow j of the same weight level
        // gets at most max x w_j / (min x w_i) + 1 chunks. Within i's class
        // that allows K class services between two of i's; each of the
        // K + 1 class-level intervals holds at most M chunks of other
        // classes.
        let (min, max) = (*sizes.iter().min().unwrap() as f64, *sizes.iter().max().unwrap() as f64);
        let class_ix = |id: u64| classes.iter().position(|c| *c == class_of[&id]).unwrap();
        let turns = |wj: f64, wi: f64| (max * wj / (min * wi)).ceil() + 1.0;
        for &i in &ids {
            let c = class_ix(i);
            let in_class = ids.iter().filter(|&&j| j != i && class_ix(j) == c).count() as f64;
            let k = in_class * turns(1.0, 1.0);
            let m: f64 = (0..3).filter(|&d| d != c).map(|d| turns(weight(classes[d]), weight(classes[c]))).sum();
            let bound = k + (k + 1.0) * m;
            let mut last = None;
            let mut worst = 0usize;
            for (k, &id) in order.iter().enumerate() {
                if id == i {
                    if let Some(l) = last { worst = worst.max(k - l - 1); }
                    last = Some(k);
                }
            }
            prop_assert!(last.is_some(), "transfer {i} never sent");
            prop_assert!(worst as f64 <= bound, "transfer {i} waited {worst} decisions, bound {bound}");
        }
    }

    /// Over every window of 1 s or longer, bytes dispatched <= rate x
    /// window + max(BDP, largest chunk) + one millisecond at the cap.
    /// Urgent chunks borrow their length: the bound grows by the largest
    /// chunk.
    #[test]
    fn the_rate_cap_holds_over_every_window(
        rate in 1_000_000u64..10_000_000_000,
        rtt in 1u64..300,
        sizes in prop::collection::vec(1..=4 * MIB, 1..32),
        gaps in prop::collection::vec(0i64..50, 1..64),
        transfers in 1usize..4,
        urgent in any::<bool>(),
    ) {
        let mut s = LinkScheduler::new(Policy::default(), rate, rtt, 0);
        let ids: Vec<u64> = (1..=transfers as u64).collect();
        let class = if urgent { Class::Urgent } else { Class::Scheduled };
        for &id in &ids {
            s.upsert(transfer(id, class, 0.0, None), 0);
        }
        let mut sent: Vec<(i64, u64)> = Vec::new();
        let mut now = 0i64;
        let mut k = 0usize;
        for &id in &ids { s.chunk_ready(TransferId(id), sizes[0]); }
        for step in 0..3000 {
            match s.next(now) {
                Decision::Send { id, bytes, .. } => {
                    sent.push((now, bytes));
                    k += 1;
                    s.chunk_ready(id, sizes[k % sizes.len()]);
                }
                // Callers may come back early or late.
                Decision::Wait { until_ms } => now = until_ms - (gaps[step % gaps.len()] % 3),
                Decision::Idle => prop_assert!(false, "idle with ready chunks"),
            }
            now += gaps[step % gaps.len()] / 10;
        }
        let bdp = rate as f64 / 8.0 * rtt as f64 / 1000.0;
        let largest = *sizes.iter().max().unwrap() as f64;
        let borrowed = if urgent { largest } else { 0.0 };
        let burst = bdp.max(largest) + rate as f64 / 8.0 / 1000.0 + borrowed;
        for a in 0..sent.len() {
            let mut sum = 0.0;
            for b in a..sent.len() {
                sum += sent[b].1 as f64;
                let window_ms = (sent[b].0 - sent[a].0).max(1000) as f64;
                let allowed = rate as f64 / 8.0 * window_ms / 1000.0 + burst;
                prop_assert!(sum <= allowed + 1.0, "{sum} bytes in {window_ms} ms, allowed {allowed}");
            }
        }
    }

    /// Admission: in a class, a transfer whose aging term is at its cap is
    /// admitted before any younger one, however high their scores.
    #[test]
    fn overdue_transfers_are_admitted_first(
        waiting in prop::collection::vec((0i64..2_000_000, 0.0f64..=1.0, prop::option::of(1e8f64..1e13)), 1..12),
        max_active in 1usize..4,
    ) {
        let policy = Policy { max_active, ..Policy::default() };
        let overdue_ms = (policy.aging_ms as f64 * (policy.aging_cap - 1.0)) as i64;
        let s = LinkScheduler::new(policy, FAST, 100, 0);
        let now = 2_000_000;
        let ts: Vec<Transfer> = waiting.iter().enumerate().map(|(i, &(created, imp, p))| Transfer {
            created_ms: created, ..transfer(i as u64 + 1, Class::Scheduled, imp, p)
        }).collect();
        let admitted = s.admit(&ts, now);
        prop_assert_eq!(admitted.len(), ts.len().min(max_active));
        let overdue = |id: TransferId| now - ts[id.0 as usize - 1].created_ms >= overdue_ms;
        let n_overdue = ts.iter().filter(|t| overdue(t.id)).count();
        for (k, id) in admitted.iter().enumerate() {
            prop_assert_eq!(overdue(*id), k < n_overdue, "admission order {:?}", admitted);
        }
    }
}

/// A stream of newer, higher-scored arrivals cannot hold an old transfer
/// back beyond the aging bound `aging x (cap - 1)`.
#[test]
fn no_transfer_waits_beyond_the_aging_bound() {
    let policy = Policy {
        max_active: 1,
        ..Policy::default()
    };
    let bound = (policy.aging_ms as f64 * (policy.aging_cap - 1.0)) as i64;
    let mut s = LinkScheduler::new(policy, FAST, 100, 0);
    let old = Transfer {
        created_ms: 0,
        ..transfer(1, Class::Scheduled, 0.0, Some(1e8))
    };
    let mut waiting = vec![old];
    let mut admitted_at = None;
    let mut next_id = 2;
    let mut now = 0;
    while now <= 2 * bound {
        // A new, far more important transfer arrives every minute; the
        // active one finishes.
        waiting.push(Transfer {
            created_ms: now,
            ..transfer(next_id, Class::Scheduled, 1.0, Some(1e12))
        });
        next_id += 1;
        for id in s.active() {
            s.remove(id);
        }
        let pick = s.admit(&waiting, now);
        assert_eq!(pick.len(), 1);
        let t = waiting.iter().find(|t| t.id == pick[0]).unwrap().clone();
        waiting.retain(|w| w.id != t.id);
        s.upsert(t, now);
        if pick[0] == TransferId(1) {
            admitted_at = Some(now);
            break;
        }
        now += 60_000;
    }
    let at = admitted_at.expect("the old transfer was never admitted");
    assert!(
        at >= bound - 60_000,
        "admitted early at {at} ms: the score should have ruled"
    );
    assert!(at <= bound, "waited {at} ms, beyond the bound {bound} ms");
}

#[test]
fn fifo_serves_the_oldest_ready_transfer_whatever_its_class() {
    let policy = Policy {
        kind: PolicyKind::Fifo,
        ..Policy::default()
    };
    let mut s = LinkScheduler::new(policy, FAST, 100, 0);
    s.upsert(
        Transfer {
            created_ms: 10,
            ..transfer(1, Class::Background, 0.0, None)
        },
        20,
    );
    s.upsert(
        Transfer {
            created_ms: 15,
            ..transfer(2, Class::Urgent, 1.0, Some(1e12))
        },
        20,
    );
    for _ in 0..3 {
        s.chunk_ready(TransferId(1), MIB);
        s.chunk_ready(TransferId(2), MIB);
    }
    let order: Vec<Decision> = (0..6).map(|k| s.next(21 + k)).collect();
    let ids: Vec<u64> = order
        .iter()
        .map(|d| match d {
            Decision::Send { id, priority, .. } => {
                assert_eq!(*priority, 0);
                id.0
            }
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(ids, vec![1, 1, 1, 2, 2, 2]);
    assert_eq!(s.next(30), Decision::Idle);
}

#[test]
fn promotion_of_an_active_transfer_preempts_and_a_rate_change_applies_at_once() {
    let mut s = LinkScheduler::new(Policy::default(), 80_000_000, 100, 0); // 10 MB/s, BDP 1 MB
    s.upsert(transfer(1, Class::Background, 0.0, None), 0);
    s.upsert(transfer(2, Class::Scheduled, 0.0, None), 0);
    for _ in 0..50 {
        s.chunk_ready(TransferId(1), 100_000);
        s.chunk_ready(TransferId(2), 100_000);
    }
    let mut now = 0;
    for _ in 0..20 {
        now += 10;
        let _ = s.next(now);
    }
    assert_eq!(s.class_of(TransferId(1)), Some(Class::Background));
    s.upsert(transfer(1, Class::Urgent, 0.0, None), now);
    // The class a sent chunk is counted in follows the promotion.
    assert_eq!(s.class_of(TransferId(1)), Some(Class::Urgent));
    assert_eq!(s.class_of(TransferId(3)), None);
    now += 10;
    assert!(matches!(
        s.next(now),
        Decision::Send {
            id: TransferId(1),
            priority: 2,
            ..
        }
    ));
    // Drain the bucket, then halve the rate: the wait doubles.
    let mut until = now;
    for _ in 0..40 {
        match s.next(now) {
            Decision::Wait { until_ms } => {
                until = until_ms;
                break;
            }
            Decision::Send { .. } => {}
            Decision::Idle => panic!("idle"),
        }
    }
    assert!(until > now, "the bucket never ran dry");
    let fast_wait = until - now;
    s.set_rate(40_000_000, now);
    match s.next(now) {
        Decision::Wait { until_ms } => assert!(
            until_ms - now >= 2 * fast_wait - 1,
            "wait {} ms at half rate vs {fast_wait} ms",
            until_ms - now
        ),
        other => panic!("{other:?}"),
    }
}

/// A bucket short of a chunk's length: a scheduled chunk waits for the
/// tokens, an urgent one (a signal's) leaves at once, and the chunk after
/// it waits until its borrowed length is repaid.
#[test]
fn an_urgent_chunk_borrows_its_length_and_the_next_one_repays_it() {
    // 100 Mbit/s, 100 ms: 12.5 kB per ms, BDP 1.25 MB.
    let mut s = LinkScheduler::new(Policy::default(), 100_000_000, 100, 0);
    s.upsert(transfer(1, Class::Scheduled, 0.0, None), 0);
    s.chunk_ready(TransferId(1), 1_250_000);
    assert!(
        matches!(s.next(0), Decision::Send { .. }),
        "a full bucket sends"
    );
    // The bucket is empty; 4 MiB more of the scheduled transfer needs
    // 4 MiB of tokens first (about 336 ms at the rate).
    s.chunk_ready(TransferId(1), 4 * MIB);
    match s.next(10) {
        Decision::Wait { until_ms } => assert!(until_ms >= 300, "waits until {until_ms}"),
        other => panic!("a scheduled chunk went without its tokens: {other:?}"),
    }
    // Promoted by a signal: it goes now, borrowing the length.
    s.upsert(transfer(1, Class::Urgent, 0.0, None), 10);
    assert!(matches!(s.next(10), Decision::Send { .. }));
    // The next urgent chunk waits for the debt: about 4 MiB less the 10
    // ms of tokens, at 12.5 kB per ms.
    s.chunk_ready(TransferId(1), 1);
    match s.next(10) {
        Decision::Wait { until_ms } => {
            let debt_ms = (4 * MIB) as f64 / 12_500.0 - 10.0;
            assert!(
                (until_ms - 10) as f64 >= debt_ms - 2.0,
                "waits until {until_ms}, debt {debt_ms} ms"
            );
        }
        other => panic!("the next chunk went while the bucket was in debt: {other:?}"),
    }
}

/// With `aging_cap` 1 aging is off: admission is by score alone, however
/// long a transfer waited.
#[test]
fn with_aging_off_admission_follows_the_score() {
    let policy = Policy {
        max_active: 1,
        aging_cap: 1.0,
        ..Policy::default()
    };
    let s = LinkScheduler::new(policy, FAST, 100, 0);
    let old = Transfer {
        created_ms: 0,
        ..transfer(1, Class::Scheduled, 0.0, None)
    };
    let new = Transfer {
        created_ms: 10_000_000,
        ..transfer(2, Class::Scheduled, 1.0, None)
    };
    assert_eq!(s.admit(&[old, new], 10_000_001), vec![TransferId(2)]);
}

/// A new policy (a pool's shared `[scheduler]` changed) applies at once:
/// admission follows its `max_active`, and the active transfers' shares
/// follow its weights.
#[test]
fn a_new_policy_applies_to_admission_and_shares_at_once() {
    let policy = Policy {
        max_active: 1,
        ..Policy::default()
    };
    let mut s = LinkScheduler::new(policy.clone(), FAST, 100, 0);
    let waiting: Vec<Transfer> = (1..=3)
        .map(|i| transfer(i, Class::Scheduled, 0.0, None))
        .collect();
    assert_eq!(s.admit(&waiting, 0).len(), 1);
    s.set_policy(Policy {
        max_active: 3,
        ..policy.clone()
    });
    assert_eq!(s.admit(&waiting, 0).len(), 3);

    // Two active transfers, one important: with the importance weight
    // at 0 they share alike; at its default the important one gets more.
    let mut s = LinkScheduler::new(
        Policy {
            weights: Weights {
                importance: 0.0,
                ..Weights::default()
            },
            ..Policy::default()
        },
        FAST,
        100,
        0,
    );
    s.upsert(transfer(1, Class::Scheduled, 1.0, None), 0);
    s.upsert(transfer(2, Class::Scheduled, 0.0, None), 0);
    let share = |s: &LinkScheduler, id: u64| {
        s.shares()
            .into_iter()
            .find(|(t, _)| *t == TransferId(id))
            .map_or(0.0, |(_, x)| x)
    };
    let (a, b) = (share(&s, 1), share(&s, 2));
    assert!((a - b).abs() < 1e-9, "{a} vs {b}");
    s.set_policy(Policy::default());
    // Scores are recomputed at the next decision.
    s.next(1);
    let (a, b) = (share(&s, 1), share(&s, 2));
    assert!(a > b * 1.5, "{a} vs {b}");
}

/// Small transfers (size known, at most `small_bytes` left) do not count
/// against `max_active`: up to `max_small_active` of them start beside the
/// per-class limit, in rank order; a transfer whose size may still grow
/// is never small, however few bytes it has now; under `fifo` the rule is
/// off.
#[test]
fn small_transfers_start_beside_max_active() {
    let policy = Policy {
        max_active: 1,
        max_small_active: 3,
        small_bytes: 4096,
        ..Policy::default()
    };
    let mut s = LinkScheduler::new(policy.clone(), FAST, 100, 0);
    let large = |id: u64| transfer(id, Class::Scheduled, 0.0, None);
    let small = |id: u64, imp: f64| Transfer {
        bytes_left: 4096,
        size_final: true,
        ..transfer(id, Class::Scheduled, imp, None)
    };
    let growing = Transfer {
        bytes_left: 10,
        size_final: false,
        ..transfer(9, Class::Scheduled, 1.0, None)
    };
    let mut waiting = vec![large(1), large(2), growing.clone()];
    // Ranked by importance: 7, 6, 5 start; 4 and 3 wait.
    waiting.extend([
        small(3, 0.1),
        small(4, 0.2),
        small(5, 0.5),
        small(6, 0.6),
        small(7, 0.7),
    ]);
    let got = s.admit(&waiting, 0);
    let mut ids: Vec<u64> = got.iter().map(|t| t.0).collect();
    ids.sort_unstable();
    // One of the class's slot (the growing one ranks first: importance 1),
    // three small ones.
    assert_eq!(ids, vec![5, 6, 7, 9], "{got:?}");
    for t in &waiting {
        if got.contains(&t.id) {
            s.upsert(t.clone(), 0);
        }
    }
    // Nothing more until one finishes; a small one's end frees a small slot.
    assert_eq!(s.admit(&waiting, 1), vec![]);
    s.remove(TransferId(6));
    waiting.retain(|t| t.id != TransferId(6) && !got.contains(&t.id));
    assert_eq!(s.admit(&waiting, 2), vec![TransferId(4)]);

    // Under fifo, small or not, max_active in all.
    let fifo = Policy {
        kind: PolicyKind::Fifo,
        ..policy
    };
    let s = LinkScheduler::new(fifo, FAST, 100, 0);
    assert_eq!(
        s.admit(&[small(3, 0.0), small(4, 0.0)], 0),
        vec![TransferId(3)]
    );
}

/// In a pool, transfers other agents run count against `max_active` per
/// class (and against `max_small_active`) like this agent's own: the
/// limits hold for the whole pool, and a class whose slots are taken
/// elsewhere admits nothing here while another class still does.
#[test]
fn transfers_running_elsewhere_in_the_pool_count_against_max_active() {
    let policy = Policy {
        max_active: 2,
        max_small_active: 1,
        small_bytes: 4096,
        ..Policy::default()
    };
    let s = LinkScheduler::new(policy.clone(), FAST, 100, 0);
    let sched = |id: u64| transfer(id, Class::Scheduled, 0.5, None);
    let urgent = |id: u64| transfer(id, Class::Urgent, 0.5, None);
    let small = |id: u64| Transfer {
        bytes_left: 100,
        size_final: true,
        ..transfer(id, Class::Background, 0.5, None)
    };
    let waiting = vec![sched(1), sched(2), urgent(3), small(4)];
    assert_eq!(s.admit_in_pool(&waiting, &[], 0).len(), 4);
    // Another agent runs one scheduled transfer: one scheduled slot left.
    let got = s.admit_in_pool(&waiting, &[sched(10)], 0);
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(got.contains(&TransferId(3)) && got.contains(&TransferId(4)));
    // A small transfer elsewhere takes the one small slot, but a small
    // one may still take a free slot of its class.
    let got = s.admit_in_pool(&waiting, &[sched(10), sched(11), small(12)], 0);
    assert_eq!(got, vec![TransferId(3), TransferId(4)]);
    // With its class full elsewhere too, only urgent starts here.
    let bg = |id: u64| transfer(id, Class::Background, 0.5, None);
    let elsewhere = [sched(10), sched(11), small(12), bg(13), bg(14)];
    assert_eq!(
        s.admit_in_pool(&waiting, &elsewhere, 0),
        vec![TransferId(3)]
    );
    // Under fifo, max_active in all, the pool's included.
    let fifo = LinkScheduler::new(
        Policy {
            kind: PolicyKind::Fifo,
            ..policy
        },
        FAST,
        100,
        0,
    );
    assert_eq!(fifo.admit_in_pool(&waiting, &[urgent(20)], 0).len(), 1);
    assert!(fifo
        .admit_in_pool(&waiting, &[urgent(20), sched(21)], 0)
        .is_empty());
}

/// An agent running its share of `max_active` (rounded up over the
/// pool's live agents) leaves a new transfer to the others for a while;
/// never a small one, never when alone, and not once it has waited.
#[test]
fn an_agent_running_its_share_leaves_new_transfers_to_its_peers() {
    let policy = Policy {
        max_active: 4,
        max_small_active: 8,
        small_bytes: 4096,
        ..Policy::default()
    };
    let s = LinkScheduler::new(policy, FAST, 100, 0);
    let big = transfer(1, Class::Scheduled, 0.5, None);
    let small = Transfer {
        bytes_left: 100,
        size_final: true,
        ..transfer(2, Class::Scheduled, 0.5, None)
    };
    // Two agents: a share of 2.
    assert!(!s.leave_to_peers(&big, 1, 2, 0, 3000));
    assert!(s.leave_to_peers(&big, 2, 2, 0, 3000));
    // Three agents: ceil(4 / 3) = 2.
    assert!(s.leave_to_peers(&big, 2, 3, 2999, 3000));
    assert!(!s.leave_to_peers(&big, 2, 3, 3000, 3000));
    assert!(!s.leave_to_peers(&big, 3, 1, 0, 3000));
    assert!(!s.leave_to_peers(&small, 9, 2, 0, 3000));
}

/// A pool's agents split a link's rate by the class rules over the
/// pool's active transfers: with nothing elsewhere an agent keeps the
/// whole link; an urgent transfer elsewhere leaves a scheduled-only agent
/// its class's floor; equal transfers of one class split it evenly; the
/// fractions of all agents add up to 1.
#[test]
fn a_pool_splits_a_link_by_class_and_score() {
    let policy = Policy::default();
    let floor = policy.floors.scheduled;
    let mut a = LinkScheduler::new(policy.clone(), FAST, 100, 0);
    let mut b = LinkScheduler::new(policy.clone(), FAST, 100, 0);
    let sched = |id: u64| transfer(id, Class::Scheduled, 0.5, None);
    let urgent = |id: u64| transfer(id, Class::Urgent, 0.5, None);
    a.upsert(sched(1), 0);
    assert_eq!(a.pool_fraction(&[], 0), 1.0);
    // Another agent runs an equal scheduled transfer: half each.
    b.upsert(sched(2), 0);
    let fa = a.pool_fraction(&[sched(2)], 0);
    let fb = b.pool_fraction(&[sched(1)], 0);
    assert!(
        (fa - 0.5).abs() < 1e-9 && (fb - 0.5).abs() < 1e-9,
        "{fa} {fb}"
    );
    // An urgent one elsewhere: the scheduled ones share the floor.
    let mut c = LinkScheduler::new(policy.clone(), FAST, 100, 0);
    c.upsert(urgent(3), 0);
    let fa = a.pool_fraction(&[sched(2), urgent(3)], 0);
    let fb = b.pool_fraction(&[sched(1), urgent(3)], 0);
    let fc = c.pool_fraction(&[sched(1), sched(2)], 0);
    assert!((fa - floor / 2.0).abs() < 1e-9, "{fa}");
    assert!((fa + fb + fc - 1.0).abs() < 1e-9, "{fa} + {fb} + {fc}");
    // An agent running nothing gets nothing while others run.
    let idle = LinkScheduler::new(policy, FAST, 100, 0);
    assert_eq!(idle.pool_fraction(&[sched(1)], 0), 0.0);
}

/// One transfer striped across two agents (both hold its parts): each is
/// due half of its share, and the two add up to what one agent alone
/// would be due; an agent holding none of its parts now is due none.
#[test]
fn a_striped_transfer_s_share_is_split_among_the_agents_holding_its_parts() {
    let policy = Policy::default();
    let sched = |id: u64| transfer(id, Class::Scheduled, 0.5, None);
    let mut a = LinkScheduler::new(policy.clone(), FAST, 100, 0);
    let mut b = LinkScheduler::new(policy, FAST, 100, 0);
    a.upsert(sched(1), 0);
    b.upsert(sched(1), 0);
    let half: HashMap<TransferId, f64> = [(TransferId(1), 0.5)].into();
    let fa = a.pool_fraction_split(&[], &half, 0);
    let fb = b.pool_fraction_split(&[], &half, 0);
    assert!(
        (fa - 0.5).abs() < 1e-9 && (fa + fb - 1.0).abs() < 1e-9,
        "{fa} {fb}"
    );
    // With another scheduled transfer elsewhere: a quarter each.
    let fa = a.pool_fraction_split(&[sched(2)], &half, 0);
    assert!((fa - 0.25).abs() < 1e-9, "{fa}");
    let none: HashMap<TransferId, f64> = [(TransferId(1), 0.0)].into();
    assert_eq!(a.pool_fraction_split(&[], &none, 0), 0.0);
    // No split: the whole share, as before.
    assert_eq!(a.pool_fraction_split(&[], &HashMap::new(), 0), 1.0);
}

/// Sends ready chunks (each sent one replaced by another of `chunk`
/// bytes, so every transfer with one ready stays ready) from `from_ms`
/// until `until_ms`; bytes sent per transfer and the time of each one's
/// first send.
fn send_until(
    s: &mut LinkScheduler,
    chunk: u64,
    from_ms: i64,
    until_ms: i64,
) -> (HashMap<u64, u64>, HashMap<u64, i64>) {
    let mut got = HashMap::new();
    let mut first = HashMap::new();
    let mut now = from_ms;
    while now < until_ms {
        match s.next(now) {
            Decision::Send { id, bytes, .. } => {
                *got.entry(id.0).or_insert(0) += bytes;
                first.entry(id.0).or_insert(now);
                s.chunk_ready(id, chunk);
            }
            Decision::Wait { until_ms } => now = until_ms.max(now + 1),
            Decision::Idle => panic!("idle with chunks ready"),
        }
    }
    (got, first)
}

/// A class capped by `set_class_rates` is held to its rate while nothing
/// else is ready (not work-conserving), slows at once (its first chunk
/// waits one chunk's time at the cap), leaves the rest to an uncapped
/// class, and gets the whole rate again when the cap is lifted.
#[test]
fn a_capped_class_is_held_to_its_rate_even_alone() {
    const RATE: u64 = 100_000_000;
    const CAP: u64 = 10_000_000;
    let chunk = MIB;
    let mut s = LinkScheduler::new(Policy::default(), RATE, 100, 0);
    s.set_chunk_bytes(chunk);
    s.upsert(transfer(1, Class::Background, 0.5, None), 0);
    s.chunk_ready(TransferId(1), chunk);
    s.set_class_rates([None, None, Some(CAP)], 0);
    assert_eq!(s.class_rates(), [None, None, Some(CAP)]);
    let bytes_in = |bps: u64, ms: i64| bps as f64 / 8.0 * ms as f64 / 1000.0;
    let (got, first) = send_until(&mut s, chunk, 0, 10_000);
    let want = bytes_in(CAP, 10_000);
    let have = got[&1] as f64;
    assert!(
        (have - want).abs() <= chunk as f64 + 1.0,
        "background alone under a cap of 10 Mbit/s sent {have} bytes in 10 s, want {want}"
    );
    let one_chunk_ms = (chunk as f64 / bytes_in(CAP, 1)) as i64;
    assert!(
        first[&1] >= one_chunk_ms,
        "first capped chunk at {} ms",
        first[&1]
    );
    // An urgent transfer beside it takes what the cap leaves.
    s.upsert(transfer(2, Class::Urgent, 0.5, None), 10_000);
    s.chunk_ready(TransferId(2), chunk);
    let (got, _) = send_until(&mut s, chunk, 10_000, 20_000);
    let bg = got.get(&1).copied().unwrap_or(0) as f64;
    let urgent = got.get(&2).copied().unwrap_or(0) as f64;
    assert!(
        bg <= bytes_in(CAP, 10_000) + 2.0 * chunk as f64,
        "background {bg}"
    );
    assert!(
        urgent >= bytes_in(RATE - CAP, 10_000) - 2.0 * chunk as f64,
        "urgent {urgent}"
    );
    // Lifted: the background class alone has the whole rate again.
    s.remove(TransferId(2));
    s.set_class_rates([None; 3], 20_000);
    let (got, _) = send_until(&mut s, chunk, 20_000, 30_000);
    let have = got[&1] as f64;
    assert!(
        have >= bytes_in(RATE, 10_000) - 2.0 * chunk as f64,
        "background uncapped sent {have} bytes in 10 s"
    );
}

/// In a pool, the classes below the highest busy anywhere are capped at
/// this agent's fraction for them; the highest is not; the capped parts
/// and the rest add up to the agent's fraction. Nothing is capped when
/// only one class is busy, or under `fifo`.
#[test]
fn a_pool_caps_the_classes_below_the_highest_busy_one() {
    let policy = Policy::default();
    let fb = policy.floors.background;
    let mut a = LinkScheduler::new(policy.clone(), FAST, 100, 0);
    a.upsert(transfer(1, Class::Background, 0.5, None), 0);
    a.upsert(transfer(2, Class::Urgent, 0.5, None), 0);
    // Both striped over two agents: half of each class's share here.
    let half: HashMap<TransferId, f64> = [(TransferId(1), 0.5), (TransferId(2), 0.5)].into();
    let ps = a.pool_share(&[], &half, 0);
    assert_eq!(ps.class_caps[0], None);
    assert_eq!(ps.class_caps[1], Some(0.0));
    let bg = ps.class_caps[2].unwrap();
    assert!((bg - fb / 2.0).abs() < 1e-9, "{ps:?}");
    assert!((ps.fraction - 0.5).abs() < 1e-9, "{ps:?}");
    assert_eq!(
        ps.fraction,
        a.pool_fraction_split(&[], &half, 0),
        "the share's fraction is pool_fraction_split's"
    );
    // Background alone in the pool: nothing capped.
    let mut b = LinkScheduler::new(policy.clone(), FAST, 100, 0);
    b.upsert(transfer(1, Class::Background, 0.5, None), 0);
    let only: HashMap<TransferId, f64> = [(TransferId(1), 0.5)].into();
    assert_eq!(b.pool_share(&[], &only, 0).class_caps, [None; 3]);
    // An urgent transfer elsewhere caps this agent's background at once.
    let ps = b.pool_share(&[transfer(2, Class::Urgent, 0.5, None)], &only, 0);
    assert_eq!(ps.class_caps[0], None);
    assert!(
        (ps.class_caps[2].unwrap() - fb / 2.0).abs() < 1e-9,
        "{ps:?}"
    );
    let fifo = Policy {
        kind: PolicyKind::Fifo,
        ..policy
    };
    let mut f = LinkScheduler::new(fifo, FAST, 100, 0);
    f.upsert(transfer(1, Class::Background, 0.5, None), 0);
    let ps = f.pool_share(&[transfer(2, Class::Urgent, 0.5, None)], &only, 0);
    assert_eq!(ps.class_caps, [None; 3]);
}
