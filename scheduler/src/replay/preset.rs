//! Generated workloads for `ferry replay --preset NAME`: the same seed
//! gives the same trace, byte for byte (a SplitMix64 generator, no
//! platform randomness).
//!
//! - [`demo_priority`]: the workload of `ferry demo --priority` with its
//!   defaults.
//! - [`seed_208`]: a day of a cross-DC link at the scale of the ByteDance
//!   Seed paper ("Teaching The Old Dog New Tricks", OSDI 2026; numbers in
//!   DESIGN.md "Why it exists"): a 60 Gbit/s, 100 ms link; 19 training
//!   jobs checkpointing every 1,000 steps; 208 background transfers (the
//!   paper's concurrent jobs) queued at the start and more arriving, the
//!   link about 92 % busy on average; loss-spike signals at the paper's
//!   rate of serious regressions (156 in 3,589 evals).

use ferry_proto::state::TransferId;

use crate::trace::{Event, Header, JobSpec, LinkSpec, Trace, What, TRACE_VERSION};
use crate::Class;

/// The simulated chunk of [`seed_208`], bytes (64 MiB: 9 ms at 60 Gbit/s;
/// a day of traffic then replays in seconds).
pub const SEED_CHUNK_BYTES: u64 = 64 << 20;

/// The link name the presets use.
pub const LINK: &str = "to-eval";

/// Names of the presets, for `--help` and errors.
pub const NAMES: [&str; 2] = ["seed-208", "demo-priority"];

/// The preset called `name` (see [`NAMES`]) with `seed` and, for
/// `seed-208`, `hours` of arrivals; `None` for an unknown name.
pub fn by_name(name: &str, seed: u64, hours: f64) -> Option<Trace> {
    match name {
        "seed-208" => Some(seed_208(seed, hours)),
        "demo-priority" => Some(demo_priority()),
        _ => None,
    }
}

/// `ferry demo --priority` with its defaults: at 1 Gbit/s and 100 ms,
/// four 400 MB background copies start at 0 s; at 3 s a 300 MB checkpoint
/// of job `mm-demo` is queued (class `scheduled`) and a loss-spike signal
/// of severity 0.9 for its job follows at once. Its transfer id is 5.
pub fn demo_priority() -> Trace {
    let mut events = Vec::new();
    for i in 1..=4u64 {
        events.push(Event {
            at_ms: 0,
            what: What::Arrival {
                id: TransferId(i),
                link: LINK.into(),
                bytes: 400_000_000,
                class: Class::Background,
                job: "archive".into(),
                importance: None,
                deadline_ms: None,
            },
        });
    }
    events.push(Event {
        at_ms: 3_000,
        what: What::Arrival {
            id: TransferId(5),
            link: LINK.into(),
            bytes: 300_000_000,
            class: Class::Scheduled,
            job: "mm-demo".into(),
            importance: None,
            deadline_ms: None,
        },
    });
    events.push(Event {
        at_ms: 3_000,
        what: What::Signal {
            job: "mm-demo".into(),
            severity: 0.9,
            kind: Some("loss_spike".into()),
        },
    });
    Trace {
        header: Header {
            ferry_trace: TRACE_VERSION,
            chunk_bytes: None,
            links: vec![LinkSpec {
                link: LINK.into(),
                rate_bps: 1_000_000_000,
                rtt_ms: 100,
            }],
            jobs: vec![],
        },
        events,
    }
}

/// SplitMix64 (Steele, Lea and Flood, 2014): small, fast, and the same
/// sequence on every platform.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Log-uniform in [lo, hi).
    fn log_uniform(&mut self, lo: f64, hi: f64) -> f64 {
        (lo.ln() + self.unit() * (hi.ln() - lo.ln())).exp()
    }
}

/// Bytes of a checkpoint per model parameter: bf16 weights (2), fp32
/// master weights (4) and two fp32 Adam moments (8), plus about 2 for
/// metadata and extra state. 162e9 parameters give the paper's 2.6 TB.
pub const CHECKPOINT_BYTES_PER_PARAM: f64 = 16.0;

/// The 19 training jobs of [`seed_208`]: (model parameters, how many jobs,
/// seconds per 1,000 steps). The paper gives the job count (19) and the
/// largest checkpoint (2.6 TB); the size mix and step times are ours.
pub const SEED_JOBS: [(f64, usize, u64); 6] = [
    (162e9, 2, 7_200),
    (70e9, 3, 5_400),
    (34e9, 4, 5_400),
    (13e9, 4, 3_600),
    (7e9, 5, 3_600),
    (1.3e9, 1, 3_600),
];

/// Probability that a checkpoint is followed by a loss-spike signal: the
/// paper's 156 serious regressions in 3,589 evals.
pub const SIGNAL_PROBABILITY: f64 = 156.0 / 3589.0;

/// Background transfers of [`seed_208`] queued in its first minute (the
/// paper's "about 208 concurrent jobs" on the link).
pub const SEED_BACKLOG: usize = 208;

/// Background arrivals per hour after the first minute (Poisson). With a
/// mean size of 53 GB (see [`SEED_BACKGROUND`]) they offer 17.0 TB/h;
/// with the checkpoints' 7.7 TB/h that is 0.92 of the 60 Gbit/s link
/// (27 TB/h). How many transfers are in the system then depends on the
/// policy; the replay prints the mean.
pub const SEED_BACKGROUND_PER_HOUR: f64 = 320.0;

/// Background kinds of [`seed_208`]: (job, share of arrivals, smallest
/// and largest bytes, log-uniform between).
pub const SEED_BACKGROUND: [(&str, f64, f64, f64); 3] = [
    ("logs", 0.6, 1e9, 1e10),
    ("datasets", 0.3, 1e10, 1e11),
    ("migrations", 0.1, 1e11, 1e12),
];

/// A day (or `hours`) at the paper's scale; see the module docs. Job `k`
/// of a size is named like `llm-70b-2`; its importance is drawn from
/// 0.0, 0.1, ..., 1.0; its first checkpoint lands at a random point of
/// its first interval. Signals follow a checkpoint within 60 s with
/// [`SIGNAL_PROBABILITY`], severity 0.5..1. Times start at 0.
pub fn seed_208(seed: u64, hours: f64) -> Trace {
    let mut rng = Rng(seed);
    let end_ms = (hours.max(0.0) * 3_600_000.0) as i64;
    let mut jobs = Vec::new();
    let mut raw: Vec<(i64, What)> = Vec::new();
    let arrival = |bytes: u64, class: Class, job: &str| What::Arrival {
        id: TransferId(0),
        link: LINK.into(),
        bytes,
        class,
        job: job.into(),
        importance: None,
        deadline_ms: None,
    };
    for (params, count, every_s) in SEED_JOBS {
        for k in 1..=count {
            let name = format!("llm-{}b-{k}", fmt_billions(params));
            let importance = (rng.unit() * 11.0).floor().min(10.0) / 10.0;
            jobs.push(JobSpec {
                job: name.clone(),
                model_params: Some(params),
                importance,
            });
            let every = every_s as i64 * 1000;
            let mut t = (rng.unit() * every as f64) as i64;
            let bytes = (params * CHECKPOINT_BYTES_PER_PARAM) as u64;
            while t < end_ms {
                raw.push((t, arrival(bytes, Class::Scheduled, &name)));
                if rng.unit() < SIGNAL_PROBABILITY {
                    let at = t + (rng.unit() * 60_000.0) as i64;
                    raw.push((
                        at,
                        What::Signal {
                            job: name.clone(),
                            severity: 0.5 + 0.5 * rng.unit(),
                            kind: Some("loss_spike".into()),
                        },
                    ));
                }
                t += every;
            }
        }
    }
    let background = |rng: &mut Rng, at: i64, raw: &mut Vec<(i64, What)>| {
        let mut pick = rng.unit();
        for (job, share, lo, hi) in SEED_BACKGROUND {
            if pick < share || job == "migrations" {
                let bytes = rng.log_uniform(lo, hi) as u64;
                raw.push((at, arrival(bytes, Class::Background, job)));
                return;
            }
            pick -= share;
        }
    };
    for _ in 0..SEED_BACKLOG {
        let at = (rng.unit() * 60_000.0) as i64;
        background(&mut rng, at, &mut raw);
    }
    let mean_gap_ms = 3_600_000.0 / SEED_BACKGROUND_PER_HOUR;
    let mut t = 60_000.0;
    loop {
        t += -(1.0 - rng.unit()).ln() * mean_gap_ms;
        if t as i64 >= end_ms {
            break;
        }
        background(&mut rng, t as i64, &mut raw);
    }
    // Time order (stable: a signal stays after its checkpoint), then ids
    // in arrival order.
    raw.sort_by_key(|(t, _)| *t);
    let mut next_id = 0u64;
    let events = raw
        .into_iter()
        .map(|(at_ms, mut what)| {
            if let What::Arrival { id, .. } = &mut what {
                next_id += 1;
                *id = TransferId(next_id);
            }
            Event { at_ms, what }
        })
        .collect();
    Trace {
        header: Header {
            ferry_trace: TRACE_VERSION,
            chunk_bytes: Some(SEED_CHUNK_BYTES),
            links: vec![LinkSpec {
                link: LINK.into(),
                rate_bps: 60_000_000_000,
                rtt_ms: 100,
            }],
            jobs,
        },
        events,
    }
}

/// 162e9 -> "162", 1.3e9 -> "1.3".
fn fmt_billions(params: f64) -> String {
    let b = params / 1e9;
    if (b - b.round()).abs() < 1e-9 {
        format!("{}", b.round() as u64)
    } else {
        format!("{b:.1}")
    }
}
