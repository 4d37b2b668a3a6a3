//! Property tests of the replay on random traces: every transfer ends the
//! way its events say, every byte of a ready transfer is sent exactly
//! once, nothing is ready sooner than its bytes take at the rate cap, and
//! the same trace replays the same.
#![allow(clippy::unwrap_used)]

use ferry_proto::state::TransferId;
use proptest::prelude::*;
use scheduler::replay::{self, End, Options};
use scheduler::trace::{Event, Header, LinkSpec, Trace, What, TRACE_VERSION};
use scheduler::{Class, Policy, PolicyKind};

const RATE: u64 = 80_000_000; // 10 MB/s
const RTT: u64 = 20;

#[derive(Debug, Clone)]
enum Op {
    Arrive(u64, Class),
    Pause(usize),
    Resume(usize),
    Cancel(usize),
    ClassOf(usize, Class),
    Signal(usize),
}

fn class() -> impl Strategy<Value = Class> {
    prop_oneof![
        Just(Class::Urgent),
        Just(Class::Scheduled),
        Just(Class::Background)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1u64..30_000_000, class()).prop_map(|(b, c)| Op::Arrive(b, c)),
        1 => (0usize..20).prop_map(Op::Pause),
        1 => (0usize..20).prop_map(Op::Resume),
        1 => (0usize..20).prop_map(Op::Cancel),
        1 => (0usize..20, class()).prop_map(|(i, c)| Op::ClassOf(i, c)),
        1 => (0usize..20).prop_map(Op::Signal),
    ]
}

/// A trace from `ops`, `gap_ms` apart; ops on transfers that have not
/// arrived are dropped. Returns the trace and, per arrival, its bytes.
fn build(ops: &[(Op, i64)]) -> (Trace, Vec<u64>) {
    let mut events = Vec::new();
    let mut bytes = Vec::new();
    let mut at = 0i64;
    for (o, gap) in ops {
        at += gap;
        let id = |i: &usize| (*i < bytes.len()).then(|| TransferId(*i as u64 + 1));
        let what = match o {
            Op::Arrive(b, c) => {
                bytes.push(*b);
                Some(What::Arrival {
                    id: TransferId(bytes.len() as u64),
                    link: "l".into(),
                    bytes: *b,
                    class: *c,
                    job: format!("job-{}", bytes.len() % 3),
                    importance: None,
                    deadline_ms: None,
                })
            }
            Op::Pause(i) => id(i).map(|id| What::Pause { id }),
            Op::Resume(i) => id(i).map(|id| What::Resume { id }),
            Op::Cancel(i) => id(i).map(|id| What::Cancel { id }),
            Op::ClassOf(i, c) => id(i).map(|id| What::Class { id, class: *c }),
            Op::Signal(i) => Some(What::Signal {
                job: format!("job-{}", i % 3),
                severity: 0.8,
                kind: None,
            }),
        };
        if let Some(what) = what {
            events.push(Event { at_ms: at, what });
        }
    }
    let trace = Trace {
        header: Header {
            ferry_trace: TRACE_VERSION,
            chunk_bytes: None,
            links: vec![LinkSpec {
                link: "l".into(),
                rate_bps: RATE,
                rtt_ms: RTT,
            }],
            jobs: vec![],
        },
        events,
    };
    (trace, bytes)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_transfer_ends_as_its_events_say_and_no_byte_is_sent_twice(
        ops in prop::collection::vec((op(), 0i64..2_000), 1..40),
        fifo in any::<bool>(),
        chunk in 100_000u64..8_000_000,
    ) {
        let (trace, bytes) = build(&ops);
        // The text form reads back to the same trace.
        prop_assert_eq!(&Trace::parse(&trace.to_json_lines()).unwrap(), &trace);
        let policy = Policy {
            kind: if fifo { PolicyKind::Fifo } else { PolicyKind::Priority },
            ..Policy::default()
        };
        let opts = Options { chunk_bytes: chunk };
        let r = replay::run(&trace, &policy, &opts);
        prop_assert_eq!(r.outcomes.len(), bytes.len());
        prop_assert_eq!(&r, &replay::run(&trace, &policy, &opts));
        let mut ready_bytes = 0;
        for (o, b) in r.outcomes.iter().zip(&bytes) {
            prop_assert_eq!(o.bytes, *b);
            // The last of pause/resume/cancel decides how it ends.
            let last = trace.events.iter().rev().find_map(|e| match &e.what {
                What::Pause { id } if *id == o.id => Some(End::Paused),
                What::Resume { id } if *id == o.id => Some(End::Ready),
                What::Cancel { id } if *id == o.id => Some(End::Cancelled),
                _ => None,
            });
            let cancelled = trace.events.iter().any(|e| matches!(&e.what, What::Cancel { id } if *id == o.id));
            match o.end {
                End::Ready => {
                    ready_bytes += o.bytes;
                    let t = o.time_to_ready_ms().unwrap();
                    // No faster than its bytes on a wire of the rate cap,
                    // plus half an RTT.
                    let floor = o.bytes as f64 * 8000.0 / RATE as f64 + (RTT / 2) as f64;
                    prop_assert!(t as f64 >= floor - 1.0, "{o:?}: {t} ms < {floor}");
                }
                // A pause or cancel after its last chunk changes nothing.
                End::Cancelled => prop_assert!(cancelled),
                End::Paused => prop_assert_eq!(last, Some(End::Paused)),
            }
        }
        prop_assert!(r.bytes_sent >= ready_bytes);
        prop_assert!(r.mean_in_system <= bytes.len() as f64 + 1e-9, "{}", r.mean_in_system);
        prop_assert!(r.bytes_sent <= bytes.iter().sum::<u64>());
        let mut ids: Vec<TransferId> = r.outcomes.iter().map(|o| o.id).collect();
        ids.dedup();
        prop_assert_eq!(ids.len(), bytes.len());
    }
}
