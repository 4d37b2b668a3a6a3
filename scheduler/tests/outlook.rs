//! The outlook's advice on a simulated link: a job that writes
//! checkpoints faster than its share of the link carries, replicating
//! every k-th checkpoint as advised, never has more than one checkpoint's
//! bytes waiting (each replicated checkpoint is ready before the next is
//! due); without the advice its backlog grows.
#![allow(clippy::unwrap_used)]

use ferry_proto::state::TransferId;
use proptest::prelude::*;
use scheduler::replay::{self, Options};
use scheduler::trace::{Event, Header, LinkSpec, Trace, What, TRACE_VERSION};
use scheduler::{Class, LinkScheduler, Policy, Transfer};

const RATE: u64 = 80_000_000; // 10 MB/s
const RTT: u64 = 20;
const CHUNK: u64 = 256 << 10;
const CHECKPOINTS: i64 = 20;

fn transfer(id: u64, class: Class, job: &str, bytes: u64, at: i64) -> Transfer {
    Transfer {
        id: TransferId(id),
        class,
        job: job.into(),
        model_params: None,
        importance: 0.5,
        bytes_left: bytes,
        created_ms: at,
        size_final: true,
        deadline_ms: None,
    }
}

/// Checkpoints of `bytes` written every `cadence` ms, every `k`-th
/// replicated, in `class`, beside a background copy of `load` bytes from
/// time 0 (0: none). Returns per replicated checkpoint its arrival and
/// ready time, in order.
fn run(bytes: u64, cadence: i64, k: i64, class: Class, load: u64) -> Vec<(i64, i64)> {
    let mut events = Vec::new();
    let mut id = 1;
    let arrival = |id: u64, t: &Transfer| What::Arrival {
        id: TransferId(id),
        link: "l".into(),
        bytes: t.bytes_left,
        class: t.class,
        job: t.job.clone(),
        importance: Some(t.importance),
        deadline_ms: None,
    };
    if load > 0 {
        let bg = transfer(id, Class::Background, "archive", load, 0);
        events.push(Event {
            at_ms: 0,
            what: arrival(id, &bg),
        });
        id += 1;
    }
    for i in (0..CHECKPOINTS).filter(|i| i % k == 0) {
        let at = i * cadence;
        let t = transfer(id, class, "train", bytes, at);
        events.push(Event {
            at_ms: at,
            what: arrival(id, &t),
        });
        id += 1;
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
    let r = replay::run(&trace, &Policy::default(), &Options { chunk_bytes: CHUNK });
    r.outcomes
        .iter()
        .filter(|o| o.job == "train")
        .map(|o| (o.arrived_ms, o.ready_ms.unwrap()))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn with_the_advice_applied_the_backlog_never_exceeds_one_checkpoint(
        bytes in 1_000_000u64..20_000_000,
        cadence in 100i64..2_000,
        background in any::<bool>(),
        class in prop_oneof![Just(Class::Scheduled), Just(Class::Background)],
    ) {
        let load = if background { 2_000_000_000 } else { 0 };
        let mut ls = LinkScheduler::new(Policy::default(), RATE, RTT, 0);
        ls.set_chunk_bytes(CHUNK);
        let others: Vec<Transfer> = if background {
            vec![transfer(1_000, Class::Background, "archive", load, 0)]
        } else {
            vec![]
        };
        let next = transfer(2_000, class, "train", bytes, 0);
        let o = ls.outlook(&next, &others, Some(cadence), 0);
        prop_assert_eq!(o.checkpoint_bytes, bytes);
        let k = i64::from(o.every_k.unwrap_or(1));
        prop_assert_eq!(o.keeps_up, Some(k == 1));
        let ready = run(bytes, cadence, k, class, load);
        prop_assert!(ready.len() as i64 >= CHECKPOINTS / k);
        for w in ready.windows(2) {
            prop_assert!(w[0].1 <= w[1].0,
                "advice every {}: checkpoint arriving at {} ready at {}, after the next arrived at {} ({:?})",
                k, w[0].0, w[0].1, w[1].0, o);
        }
        if k > 1 {
            // The rate it names would carry one per interval.
            let need = o.rate_needed_bps.unwrap();
            prop_assert!(need > RATE);
            // Without the advice, checkpoints pile up (when the time to
            // ready alone, without the margin, is over the interval).
            if o.next_ready_ms.unwrap() > cadence + RTT as i64 {
                let all = run(bytes, cadence, 1, class, load);
                prop_assert!(all.windows(2).any(|w| w[0].1 > w[1].0), "{:?}", o);
            }
        }
    }
}
