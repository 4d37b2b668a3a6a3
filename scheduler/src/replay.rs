//! Policy replay: a [`Trace`] run through the agents' own [`LinkScheduler`]
//! (admission, class floors, shares by score, signals, the rate cap) on a
//! simulated link, in simulated time (ARCHITECTURE.md "Policy replay").
//!
//! What happens to a transfer, as in a source agent:
//! - it waits in its link's queue until [`LinkScheduler::admit`] starts
//!   it (at most `max_active` per class and, besides, up to
//!   `max_small_active` small transfers, or `max_active` in all under
//!   `fifo`); a trace gives every size at arrival, so sizes are final;
//! - once started, its data is always ready (one chunk of
//!   [`Options::chunk_bytes`] at a time, the last one shorter), and
//!   [`LinkScheduler::next`] decides which chunk goes next under the rate
//!   cap;
//! - the link is a wire of the rate cap: a chunk the scheduler sends at
//!   `t` goes on it when the chunks before it are through (at `max(t,
//!   wire free)`), takes `bytes / rate`, and is at the sink half an RTT
//!   later; the transfer is *ready* (published at the sink) when its last
//!   chunk arrives, and frees its admission slot half an RTT later, when
//!   the source hears the commit acknowledged. Alone on the link, a
//!   transfer of `B` bytes is ready `B x 8 / rate + RTT / 2` after it
//!   starts (packet headers are not counted);
//! - a signal raises its job's severity on every link and promotes the
//!   job's newest unfinished transfer not in class `background` to
//!   `urgent` for `urgent_for`, as the agent does; an operator's class
//!   change ends a promotion; a pause takes a transfer off the link
//!   (keeping the bytes sent) until its resume.
//!
//! Not modelled (see `ferry replay --help`): CPU, disk and storage
//! limits, packet loss and congestion control (the link always delivers
//! its rate cap), the open's and commit's extra round trips of a resumed
//! or re-saved transfer, checkpoints still being written (a transfer's
//! bytes are all there when it arrives), the sink's verification and
//! publish time, and other agents.
//!
//! Same trace, policy and options: same report, bit for bit (no clock,
//! no randomness, ordered maps only).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ferry_proto::state::TransferId;

use crate::score::effective_class;
use crate::trace::{JobSpec, Trace, What};
use crate::{Class, Decision, LinkScheduler, Policy, Transfer};

pub mod preset;

/// Replay settings other than the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// The scheduling quantum, bytes: the length of each simulated chunk.
    /// Default 4 MiB, the agents' default `chunk_size`. Larger values run
    /// faster; at 60 Gbit/s a 64 MiB chunk is 9 ms on the wire.
    pub chunk_bytes: u64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            chunk_bytes: 4 << 20,
        }
    }
}

/// How a transfer's replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Published at the sink (`ready_ms` is set).
    Ready,
    /// Cancelled by an operator first.
    Cancelled,
    /// Paused and never resumed.
    Paused,
}

/// One transfer's fate in a replay.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Transfer id.
    pub id: TransferId,
    /// Link.
    pub link: String,
    /// Job.
    pub job: String,
    /// Payload bytes.
    pub bytes: u64,
    /// The class it is counted in: `urgent` if it was urgent at any time
    /// (by arrival, an operator or a signal's promotion), else its class
    /// at arrival or the highest an operator gave it.
    pub group: Class,
    /// When it arrived, Unix ms.
    pub arrived_ms: i64,
    /// When it was published at the sink, Unix ms.
    pub ready_ms: Option<i64>,
    /// Its deadline, Unix ms, if it had one.
    pub deadline_ms: Option<i64>,
    /// How it ended.
    pub end: End,
}

impl Outcome {
    /// Time to ready (arrival to publish), ms.
    pub fn time_to_ready_ms(&self) -> Option<i64> {
        self.ready_ms.map(|r| r - self.arrived_ms)
    }
}

/// The result of [`run`].
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// One per arrival, in arrival order.
    pub outcomes: Vec<Outcome>,
    /// The first event's time, Unix ms.
    pub start_ms: i64,
    /// When the last transfer ended (or the last event), Unix ms.
    pub end_ms: i64,
    /// Chunks sent (scheduler decisions).
    pub chunks: u64,
    /// Payload bytes sent.
    pub bytes_sent: u64,
    /// Time-averaged number of transfers arrived and not yet ready or
    /// cancelled (queued, moving or paused), over `start_ms..end_ms`.
    pub mean_in_system: f64,
}

impl Report {
    /// Simulated duration, seconds.
    pub fn simulated_s(&self) -> f64 {
        (self.end_ms - self.start_ms) as f64 / 1000.0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Queued,
    Active,
    /// All chunks sent; ready at `ready_ms`, slot free at `free_ms`.
    Sent,
    Paused,
    Done,
    Cancelled,
}

struct Sim {
    link: String,
    job: String,
    bytes: u64,
    sent: u64,
    class: Class,
    importance: Option<f64>,
    urgent_until: Option<i64>,
    created_ms: i64,
    state: State,
    ever_urgent: bool,
    top_class: Class,
    ready_ms: Option<i64>,
    free_ms: i64,
    deadline_ms: Option<i64>,
    index: usize,
    /// When it was cancelled, Unix ms.
    cancelled_ms: Option<i64>,
}

struct LinkSim {
    sched: LinkScheduler,
    rate_bps: u64,
    rtt_ms: u64,
    /// Something changed that can change admission.
    dirty: bool,
    /// The rate cap says wait until then.
    wake_ms: Option<i64>,
    /// When the wire is free of the chunks already sent, Unix ms.
    wire_free: f64,
    /// Queued transfers of this link (waiting for admission).
    queued: BTreeSet<TransferId>,
}

struct World<'a> {
    policy: &'a Policy,
    chunk: u64,
    jobs: HashMap<String, JobSpec>,
    links: BTreeMap<String, LinkSim>,
    transfers: BTreeMap<TransferId, Sim>,
    /// (free time, id) of transfers whose last chunk is sent.
    freeing: BTreeSet<(i64, TransferId)>,
    /// (promotion end, id) of promoted transfers.
    promotions: BTreeSet<(i64, TransferId)>,
    chunks: u64,
    bytes_sent: u64,
    in_system: usize,
    /// Per job, its transfers not yet done or cancelled, by (arrival, id).
    by_job: HashMap<String, BTreeSet<(i64, TransferId)>>,
}

impl World<'_> {
    fn view(&self, id: TransferId, t: &Sim, now: i64) -> Transfer {
        let job = self.jobs.get(&t.job);
        Transfer {
            id,
            class: effective_class(t.class, t.urgent_until, now),
            job: t.job.clone(),
            model_params: job.and_then(|j| j.model_params),
            importance: t.importance.or(job.map(|j| j.importance)).unwrap_or(0.0),
            bytes_left: t.bytes - t.sent,
            created_ms: t.created_ms,
            // A trace gives each transfer's size at its arrival.
            size_final: true,
            deadline_ms: t.deadline_ms,
        }
    }

    /// Tells the link's scheduler about a changed active transfer.
    fn refresh(&mut self, id: TransferId, now: i64) {
        let Some(t) = self.transfers.get(&id) else {
            return;
        };
        if matches!(t.state, State::Active | State::Sent) {
            let v = self.view(id, t, now);
            if let Some(l) = self.links.get_mut(&t.link) {
                l.sched.upsert(v, now);
                l.dirty = true;
            }
        } else if let Some(l) = self.links.get_mut(&t.link) {
            l.dirty = true;
        }
    }

    fn mark_urgent(&mut self, id: TransferId) {
        if let Some(t) = self.transfers.get_mut(&id) {
            t.ever_urgent = true;
        }
    }

    fn apply(&mut self, what: &What, now: i64, index: usize) {
        match what {
            What::Arrival {
                id,
                link,
                bytes,
                class,
                job,
                importance,
                deadline_ms,
            } => {
                self.transfers.insert(
                    *id,
                    Sim {
                        link: link.clone(),
                        job: job.clone(),
                        bytes: *bytes,
                        sent: 0,
                        class: *class,
                        importance: *importance,
                        urgent_until: None,
                        created_ms: now,
                        state: State::Queued,
                        ever_urgent: *class == Class::Urgent,
                        top_class: *class,
                        ready_ms: None,
                        free_ms: 0,
                        deadline_ms: *deadline_ms,
                        index,
                        cancelled_ms: None,
                    },
                );
                self.in_system += 1;
                self.by_job
                    .entry(job.clone())
                    .or_default()
                    .insert((now, *id));
                if let Some(l) = self.links.get_mut(link) {
                    l.queued.insert(*id);
                    l.dirty = true;
                }
            }
            What::Class { id, class } => {
                if let Some(t) = self.transfers.get_mut(id) {
                    t.class = *class;
                    t.urgent_until = None;
                    t.top_class = t.top_class.min(*class);
                    if *class == Class::Urgent {
                        t.ever_urgent = true;
                    }
                }
                self.refresh(*id, now);
            }
            What::Importance { id, importance } => {
                if let Some(t) = self.transfers.get_mut(id) {
                    t.importance = *importance;
                }
                self.refresh(*id, now);
            }
            What::Job(j) => {
                self.jobs.insert(j.job.clone(), j.clone());
                let ids: Vec<TransferId> = self
                    .by_job
                    .get(&j.job)
                    .map(|s| s.iter().map(|(_, id)| *id).collect())
                    .unwrap_or_default();
                for id in ids {
                    self.refresh(id, now);
                }
            }
            What::Pause { id } => {
                if let Some(t) = self.transfers.get_mut(id) {
                    if matches!(t.state, State::Queued | State::Active) {
                        t.state = State::Paused;
                        if let Some(l) = self.links.get_mut(&t.link) {
                            l.sched.remove(*id);
                            l.queued.remove(id);
                            l.dirty = true;
                        }
                    }
                }
            }
            What::Resume { id } => {
                if let Some(t) = self.transfers.get_mut(id) {
                    if t.state == State::Paused {
                        t.state = State::Queued;
                        if let Some(l) = self.links.get_mut(&t.link) {
                            l.queued.insert(*id);
                            l.dirty = true;
                        }
                    }
                }
            }
            What::Cancel { id } => {
                if let Some(t) = self.transfers.get_mut(id) {
                    if matches!(t.state, State::Queued | State::Active | State::Paused) {
                        t.state = State::Cancelled;
                        t.cancelled_ms = Some(now);
                        self.in_system -= 1;
                        if let Some(s) = self.by_job.get_mut(&t.job) {
                            s.remove(&(t.created_ms, *id));
                        }
                        if let Some(l) = self.links.get_mut(&t.link) {
                            l.sched.remove(*id);
                            l.queued.remove(id);
                            l.dirty = true;
                        }
                    }
                }
            }
            What::Rate { link, rate_bps } => {
                if let Some(l) = self.links.get_mut(link) {
                    l.rate_bps = *rate_bps;
                    l.sched.set_rate(*rate_bps, now);
                    l.wake_ms = None;
                }
            }
            What::Signal { job, severity, .. } => {
                for l in self.links.values_mut() {
                    l.sched.signal(job, *severity, now);
                    l.dirty = true;
                }
                // The job's newest unfinished transfer outside background.
                let transfers = &self.transfers;
                let newest = self.by_job.get(job).and_then(|s| {
                    s.iter().rev().map(|(_, id)| *id).find(|id| {
                        transfers
                            .get(id)
                            .is_some_and(|t| t.class != Class::Background)
                    })
                });
                if let Some(id) = newest {
                    let until = now.saturating_add(self.policy.urgent_for_ms as i64);
                    if let Some(t) = self.transfers.get_mut(&id) {
                        if let Some(old) = t.urgent_until {
                            self.promotions.remove(&(old, id));
                        }
                        t.urgent_until = Some(until);
                    }
                    self.promotions.insert((until, id));
                    self.mark_urgent(id);
                    self.refresh(id, now);
                }
            }
        }
    }

    /// Starts what the scheduler admits on `name`.
    fn admit(&mut self, name: &str, now: i64) {
        let waiting: Vec<Transfer> = self
            .links
            .get(name)
            .map(|l| {
                l.queued
                    .iter()
                    .filter_map(|id| self.transfers.get(id).map(|t| self.view(*id, t, now)))
                    .collect()
            })
            .unwrap_or_default();
        let Some(l) = self.links.get_mut(name) else {
            return;
        };
        l.dirty = false;
        if waiting.is_empty() {
            return;
        }
        let start = l.sched.admit(&waiting, now);
        for id in start {
            let Some(v) = waiting.iter().find(|w| w.id == id).cloned() else {
                continue;
            };
            l.sched.upsert(v, now);
            l.queued.remove(&id);
            let Some(t) = self.transfers.get_mut(&id) else {
                continue;
            };
            t.state = State::Active;
            if t.sent >= t.bytes {
                // Nothing to send: an open and a commit.
                let half = (l.rtt_ms / 2) as i64;
                t.state = State::Sent;
                t.ready_ms = Some(now + half);
                t.free_ms = now + 2 * half;
                self.freeing.insert((t.free_ms, id));
            } else {
                l.sched
                    .chunk_ready(id, (t.bytes - t.sent).min(self.chunk).max(1));
            }
        }
    }

    /// Sends what the link's scheduler decides until it says wait or idle.
    fn dispatch(&mut self, name: &str, now: i64) {
        let Some(l) = self.links.get_mut(name) else {
            return;
        };
        l.wake_ms = None;
        loop {
            match l.sched.next(now) {
                Decision::Send { id, bytes, .. } => {
                    self.chunks += 1;
                    self.bytes_sent += bytes;
                    let Some(t) = self.transfers.get_mut(&id) else {
                        continue;
                    };
                    t.sent = (t.sent + bytes).min(t.bytes);
                    let on_wire = l.wire_free.max(now as f64);
                    l.wire_free = on_wire + bytes as f64 * 8000.0 / l.rate_bps.max(1) as f64;
                    if t.sent < t.bytes {
                        l.sched.chunk_ready(id, (t.bytes - t.sent).min(self.chunk));
                    } else {
                        // Through the wire, then half an RTT.
                        let half = (l.rtt_ms / 2) as i64;
                        let ready = (l.wire_free.ceil() as i64).max(now) + half;
                        t.state = State::Sent;
                        t.ready_ms = Some(ready);
                        t.free_ms = ready + half;
                        self.freeing.insert((t.free_ms, id));
                    }
                }
                Decision::Wait { until_ms } => {
                    l.wake_ms = Some(until_ms);
                    return;
                }
                Decision::Idle => return,
            }
        }
    }
}

/// Replays `trace` under `policy`: every arrival is run to its end
/// (ready, cancelled, or paused and never resumed). Events at the same
/// millisecond apply in trace order before the scheduler decides.
///
/// A trace with events but no arrivals gives an empty report. Transfers
/// on a link the header does not list never start ([`Trace::parse`]
/// refuses such traces).
pub fn run(trace: &Trace, policy: &Policy, opts: &Options) -> Report {
    let start = trace.events.first().map_or(0, |e| e.at_ms);
    let mut w = World {
        policy,
        chunk: opts.chunk_bytes.max(1),
        jobs: trace
            .header
            .jobs
            .iter()
            .map(|j| (j.job.clone(), j.clone()))
            .collect(),
        links: trace
            .header
            .links
            .iter()
            .map(|l| {
                (
                    l.link.clone(),
                    LinkSim {
                        sched: {
                            let mut s =
                                LinkScheduler::new(policy.clone(), l.rate_bps, l.rtt_ms, start);
                            s.set_chunk_bytes(opts.chunk_bytes.max(1));
                            s
                        },
                        rate_bps: l.rate_bps.max(1),
                        rtt_ms: l.rtt_ms,
                        dirty: false,
                        wake_ms: None,
                        wire_free: start as f64,
                        queued: BTreeSet::new(),
                    },
                )
            })
            .collect(),
        transfers: BTreeMap::new(),
        freeing: BTreeSet::new(),
        promotions: BTreeSet::new(),
        chunks: 0,
        bytes_sent: 0,
        in_system: 0,
        by_job: HashMap::new(),
    };
    let names: Vec<String> = w.links.keys().cloned().collect();
    let mut next_event = 0usize;
    let mut arrivals = 0usize;
    let mut now = start;
    let mut end = start;
    loop {
        // Trace events due now.
        while let Some(e) = trace.events.get(next_event).filter(|e| e.at_ms <= now) {
            w.apply(&e.what, now, arrivals);
            if matches!(e.what, What::Arrival { .. }) {
                arrivals += 1;
            }
            next_event += 1;
        }
        // Promotions that ended.
        while let Some(&(until, id)) = w.promotions.first().filter(|(u, _)| *u <= now) {
            w.promotions.remove(&(until, id));
            w.refresh(id, now);
        }
        // Transfers whose commit is acknowledged.
        while let Some(&(at, id)) = w.freeing.first().filter(|(a, _)| *a <= now) {
            w.freeing.remove(&(at, id));
            if let Some(t) = w.transfers.get_mut(&id) {
                if t.state == State::Sent {
                    t.state = State::Done;
                    w.in_system -= 1;
                    if let Some(s) = w.by_job.get_mut(&t.job) {
                        s.remove(&(t.created_ms, id));
                    }
                    end = end.max(t.ready_ms.unwrap_or(at));
                    if let Some(l) = w.links.get_mut(&t.link) {
                        l.sched.remove(id);
                        l.dirty = true;
                    }
                }
            }
        }
        for name in &names {
            if w.links.get(name).is_some_and(|l| l.dirty) {
                w.admit(name, now);
            }
            let due = w
                .links
                .get(name)
                .is_some_and(|l| l.wake_ms.is_none_or(|t| t <= now));
            if due {
                w.dispatch(name, now);
            }
        }
        // The next moment anything happens.
        let mut next = trace.events.get(next_event).map(|e| e.at_ms);
        let mut at = |t: i64| next = Some(next.map_or(t, |n: i64| n.min(t)));
        if let Some(&(t, _)) = w.freeing.first() {
            at(t);
        }
        if let Some(&(t, _)) = w.promotions.first() {
            at(t);
        }
        for l in w.links.values() {
            if let Some(t) = l.wake_ms {
                at(t);
            }
        }
        let Some(next) = next else { break };
        // Promotions of finished transfers would keep the loop alive
        // alone; they change nothing.
        let busy = w.in_system > 0 || next_event < trace.events.len();
        if !busy {
            break;
        }
        let next = next.max(now + 1);
        now = next;
    }
    if let Some(last) = trace.events.last() {
        end = end.max(last.at_ms);
    }
    let mut outcomes: Vec<(usize, Outcome)> = w
        .transfers
        .iter()
        .map(|(id, t)| {
            let group = if t.ever_urgent {
                Class::Urgent
            } else {
                t.top_class
            };
            let end = match t.state {
                State::Done | State::Sent => End::Ready,
                State::Cancelled => End::Cancelled,
                State::Paused | State::Queued | State::Active => End::Paused,
            };
            (
                t.index,
                Outcome {
                    id: *id,
                    link: t.link.clone(),
                    job: t.job.clone(),
                    bytes: t.bytes,
                    group,
                    arrived_ms: t.created_ms,
                    ready_ms: if end == End::Ready { t.ready_ms } else { None },
                    deadline_ms: t.deadline_ms,
                    end,
                },
            )
        })
        .collect();
    outcomes.sort_by_key(|(i, _)| *i);
    // Time in the system: arrival to ready, to cancel, or to the end.
    let area: f64 = w
        .transfers
        .values()
        .map(|t| {
            let until = match t.state {
                State::Done | State::Sent => t.ready_ms.unwrap_or(end),
                State::Cancelled => t.cancelled_ms.unwrap_or(end),
                _ => end,
            };
            (until.min(end) - t.created_ms).max(0) as f64
        })
        .sum();
    let span = (end - start).max(1) as f64;
    Report {
        outcomes: outcomes.into_iter().map(|(_, o)| o).collect(),
        start_ms: start,
        end_ms: end,
        chunks: w.chunks,
        bytes_sent: w.bytes_sent,
        mean_in_system: area / span,
    }
}

/// The time to ready (ms) transfer `id` of `trace` would have alone on
/// its link: the same arrival, the link's rate changes, nothing else.
/// `None` if `id` does not arrive in the trace or never becomes ready
/// alone (cancelled or paused for good).
pub fn alone_ms(trace: &Trace, policy: &Policy, opts: &Options, id: TransferId) -> Option<i64> {
    let link = trace.events.iter().find_map(|e| match &e.what {
        What::Arrival { id: a, link, .. } if *a == id => Some(link.clone()),
        _ => None,
    })?;
    let events = trace
        .events
        .iter()
        .filter(|e| match &e.what {
            What::Arrival { id: a, .. }
            | What::Pause { id: a }
            | What::Resume { id: a }
            | What::Cancel { id: a }
            | What::Class { id: a, .. }
            | What::Importance { id: a, .. } => *a == id,
            What::Rate { link: l, .. } => *l == link,
            What::Job(_) => true,
            What::Signal { .. } => false,
        })
        .cloned()
        .collect();
    let solo = Trace {
        header: trace.header.clone(),
        events,
    };
    run(&solo, policy, opts)
        .outcomes
        .first()
        .and_then(Outcome::time_to_ready_ms)
}

/// Per-class figures of a replay.
#[derive(Debug, Clone, PartialEq)]
pub struct ClassSummary {
    /// The class (see [`Outcome::group`]).
    pub class: Class,
    /// Transfers counted in it.
    pub arrived: usize,
    /// Of them, ready.
    pub ready: usize,
    /// Time to ready percentiles (nearest rank) of the ready ones,
    /// seconds: p50, p90, p99, max. `None` when none is ready.
    pub time_to_ready_s: Option<[f64; 4]>,
    /// For `urgent`: time to ready over time alone, p50 and max.
    pub over_alone: Option<[f64; 2]>,
    /// Deadlines met and deadlines given, when any transfer had one.
    pub deadlines: Option<(usize, usize)>,
}

/// The value at percentile `p` (0..100) of sorted `v`, nearest rank.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v.get(rank.clamp(1, v.len()) - 1).copied()
}

/// Summarises `report` per class, `urgent` first; classes with no
/// transfer are left out. The over-alone ratio replays each ready urgent
/// transfer alone ([`alone_ms`]) under the same policy and options.
pub fn summarize(
    trace: &Trace,
    policy: &Policy,
    opts: &Options,
    report: &Report,
) -> Vec<ClassSummary> {
    let mut out = Vec::new();
    for class in [Class::Urgent, Class::Scheduled, Class::Background] {
        let of: Vec<&Outcome> = report
            .outcomes
            .iter()
            .filter(|o| o.group == class)
            .collect();
        if of.is_empty() {
            continue;
        }
        let mut times: Vec<f64> = of
            .iter()
            .filter_map(|o| o.time_to_ready_ms())
            .map(|ms| ms as f64 / 1000.0)
            .collect();
        times.sort_by(f64::total_cmp);
        let pct = |p| percentile(&times, p);
        let time_to_ready_s = match (pct(50.0), pct(90.0), pct(99.0), times.last()) {
            (Some(a), Some(b), Some(c), Some(d)) => Some([a, b, c, *d]),
            _ => None,
        };
        let over_alone = if class == Class::Urgent {
            let mut r: Vec<f64> = of
                .iter()
                .filter_map(|o| {
                    let t = o.time_to_ready_ms()?;
                    let a = alone_ms(trace, policy, opts, o.id)?;
                    Some(t as f64 / a.max(1) as f64)
                })
                .collect();
            r.sort_by(f64::total_cmp);
            match (percentile(&r, 50.0), r.last()) {
                (Some(a), Some(m)) => Some([a, *m]),
                _ => None,
            }
        } else {
            None
        };
        let with: Vec<&&Outcome> = of.iter().filter(|o| o.deadline_ms.is_some()).collect();
        let deadlines = (!with.is_empty()).then(|| {
            let met = with
                .iter()
                .filter(|o| matches!((o.ready_ms, o.deadline_ms), (Some(r), Some(d)) if r <= d))
                .count();
            (met, with.len())
        });
        out.push(ClassSummary {
            class,
            arrived: of.len(),
            ready: times.len(),
            time_to_ready_s,
            over_alone,
            deadlines,
        });
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::trace::{Event, Header, LinkSpec};
    use crate::PolicyKind;

    fn fifo() -> Policy {
        Policy {
            kind: PolicyKind::Fifo,
            ..Policy::default()
        }
    }

    fn one_link(events: Vec<Event>) -> Trace {
        Trace {
            header: Header {
                ferry_trace: crate::trace::TRACE_VERSION,
                chunk_bytes: None,
                links: vec![LinkSpec {
                    link: "l".into(),
                    rate_bps: 8_000_000,
                    rtt_ms: 100,
                }],
                jobs: vec![],
            },
            events,
        }
    }

    fn arrive(at_ms: i64, id: u64, bytes: u64, class: Class) -> Event {
        Event {
            at_ms,
            what: What::Arrival {
                id: TransferId(id),
                link: "l".into(),
                bytes,
                class,
                job: format!("job-{id}"),
                importance: None,
                deadline_ms: Some(at_ms + 3_000),
            },
        }
    }

    fn at(at_ms: i64, what: What) -> Event {
        Event { at_ms, what }
    }

    fn ready_s(r: &Report, id: u64) -> Option<f64> {
        r.outcomes
            .iter()
            .find(|o| o.id == TransferId(id))
            .and_then(|o| o.time_to_ready_ms())
            .map(|ms| ms as f64 / 1000.0)
    }

    #[test]
    fn a_transfer_alone_takes_its_bytes_over_the_rate_plus_half_an_rtt() {
        // 1 MB/s: 2 MB take 2 s on the wire, + 50 ms; the bucket starts
        // with one BDP (100 kB), so at most 0.1 s earlier.
        let t = one_link(vec![arrive(0, 1, 2_000_000, Class::Scheduled)]);
        let opts = Options {
            chunk_bytes: 100_000,
        };
        let r = run(&t, &Policy::default(), &opts);
        let s = ready_s(&r, 1).unwrap();
        assert!((1.9..=2.1).contains(&s), "{s}");
        assert_eq!(r.bytes_sent, 2_000_000);
        assert_eq!(r.chunks, 20);
        assert_eq!(
            alone_ms(&t, &Policy::default(), &opts, TransferId(1)),
            Some((s * 1000.0) as i64)
        );
    }

    #[test]
    fn alone_the_time_is_bytes_over_the_rate_plus_half_an_rtt() {
        // 20 MB at 100 Mbit/s with 100 ms: 1.6 s + 50 ms; 1 GB at 60 Gbit/s
        // and 100 ms: 133 ms + 50 ms; 1 MB at 1 kbit/s: 8000 s + 5 ms. A
        // chunk longer than the bucket (one BDP) waits for a full bucket
        // first, as in the agents' LinkScheduler: at most one chunk's time
        // more.
        for (bytes, rate, rtt, want_ms) in [
            (20_000_000u64, 100_000_000u64, 100u64, 1_650i64),
            (1_000_000_000, 60_000_000_000, 100, 184),
            (1_000_000, 1_000, 10, 8_000_005),
        ] {
            for chunk in [64u64 << 10, 4 << 20, 64 << 20] {
                let mut t = one_link(vec![arrive(0, 1, bytes, Class::Scheduled)]);
                t.header.links[0].rate_bps = rate;
                t.header.links[0].rtt_ms = rtt;
                let opts = Options { chunk_bytes: chunk };
                let got = alone_ms(&t, &Policy::default(), &opts, TransferId(1)).unwrap();
                let bdp = rate as f64 / 8000.0 * rtt as f64;
                let chunk = chunk.min(bytes) as f64;
                let slack = ((chunk - bdp).max(0.0) * 8000.0 / rate as f64).ceil() as i64 + 2;
                assert!(
                    got >= want_ms - 1 && got <= want_ms + slack,
                    "{bytes} B at {rate} bit/s, chunk {chunk}: {got} ms, want {want_ms} (+{slack})"
                );
            }
        }
    }

    #[test]
    fn rate_changes_pauses_and_cancels_take_effect() {
        let opts = Options {
            chunk_bytes: 100_000,
        };
        let halved = one_link(vec![
            arrive(0, 1, 2_000_000, Class::Scheduled),
            at(
                0,
                What::Rate {
                    link: "l".into(),
                    rate_bps: 4_000_000,
                },
            ),
        ]);
        let s = ready_s(&run(&halved, &Policy::default(), &opts), 1).unwrap();
        assert!((3.8..=4.2).contains(&s), "{s}");
        let paused = one_link(vec![
            arrive(0, 1, 2_000_000, Class::Scheduled),
            at(1_000, What::Pause { id: TransferId(1) }),
            at(6_000, What::Resume { id: TransferId(1) }),
        ]);
        let s = ready_s(&run(&paused, &Policy::default(), &opts), 1).unwrap();
        assert!((6.9..=7.2).contains(&s), "{s}");
        let never = one_link(vec![
            arrive(0, 1, 2_000_000, Class::Scheduled),
            at(1_000, What::Pause { id: TransferId(1) }),
            arrive(1_000, 2, 1_000_000, Class::Background),
            at(1_500, What::Cancel { id: TransferId(2) }),
        ]);
        let r = run(&never, &Policy::default(), &opts);
        assert_eq!(r.outcomes[0].end, End::Paused);
        assert_eq!(r.outcomes[1].end, End::Cancelled);
        assert!(r.bytes_sent < 2_000_000, "{}", r.bytes_sent);
    }

    #[test]
    fn under_fifo_the_oldest_goes_first_and_under_priority_a_signal_jumps_the_queue() {
        let opts = Options {
            chunk_bytes: 100_000,
        };
        let t = one_link(vec![
            arrive(0, 1, 4_000_000, Class::Background),
            arrive(0, 2, 4_000_000, Class::Background),
            arrive(100, 3, 1_000_000, Class::Scheduled),
            at(
                100,
                What::Signal {
                    job: "job-3".into(),
                    severity: 1.0,
                    kind: None,
                },
            ),
        ]);
        let f = run(&t, &fifo(), &opts);
        let p = run(&t, &Policy::default(), &opts);
        // fifo: behind both background copies (9 MB at 1 MB/s).
        assert!(ready_s(&f, 3).unwrap() > 8.0, "{f:?}");
        // priority: urgent gets 95 % of the link.
        assert!(ready_s(&p, 3).unwrap() < 1.3, "{p:?}");
        assert_eq!(p.outcomes[2].group, Class::Urgent);
        assert_eq!(f.outcomes[2].group, Class::Urgent);
        let sum = summarize(&t, &Policy::default(), &opts, &p);
        assert_eq!(sum[0].class, Class::Urgent);
        assert_eq!(sum[0].deadlines, Some((1, 1)));
        assert!(sum[0].over_alone.unwrap()[1] < 1.2, "{sum:?}");
        let sum = summarize(&t, &fifo(), &opts, &f);
        assert_eq!(sum[0].deadlines, Some((0, 1)));
        assert_eq!(sum[1].class, Class::Background);
        assert_eq!(sum[1].arrived, 2);
    }

    #[test]
    fn demo_priority_urgent_is_near_its_solo_time_under_priority_and_far_under_fifo() {
        let t = preset::demo_priority();
        let opts = Options::default();
        let alone = alone_ms(&t, &Policy::default(), &opts, TransferId(5)).unwrap() as f64;
        let p = run(&t, &Policy::default(), &opts);
        let f = run(&t, &fifo(), &opts);
        let over = |r: &Report| ready_s(r, 5).unwrap() * 1000.0 / alone;
        assert!(over(&p) <= 1.1, "priority {}", over(&p));
        assert!(over(&f) >= 2.0, "fifo {}", over(&f));
        // Every byte of every transfer went out once.
        let total: u64 = t
            .events
            .iter()
            .filter_map(|e| match e.what {
                What::Arrival { bytes, .. } => Some(bytes),
                _ => None,
            })
            .sum();
        assert_eq!(p.bytes_sent, total);
        assert_eq!(f.bytes_sent, total);
    }

    #[test]
    fn the_same_trace_replays_the_same() {
        let t = preset::seed_208(7, 1.0);
        let again = preset::seed_208(7, 1.0);
        assert_eq!(t.to_json_lines(), again.to_json_lines());
        assert_ne!(t.to_json_lines(), preset::seed_208(8, 1.0).to_json_lines());
        let opts = Options {
            chunk_bytes: 1 << 30,
        };
        let a = run(&t, &Policy::default(), &opts);
        let b = run(&t, &Policy::default(), &opts);
        assert_eq!(a, b);
        assert_eq!(a.outcomes.len(), t.arrivals());
        assert!(a.outcomes.iter().all(|o| o.end == End::Ready));
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert_eq!(percentile(&[3.0], 1.0), Some(3.0));
        assert_eq!(percentile(&[], 50.0), None);
    }
}
