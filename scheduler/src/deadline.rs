//! Deadlines: the fluid model that predicts when transfers are ready, the
//! admission answer built on it, and the slack test that tells the link's
//! dispatcher when a class must serve its deadlines earliest-deadline-first
//! (EDF) ahead of score order (ARCHITECTURE.md "Deadlines").
//!
//! **Fluid model.** The link is a fluid of the rate cap. Each class with
//! a transfer left gets its class weight of it (as the dispatcher does:
//! each lower busy class its floor, the highest busy class the rest);
//! within a class, the transfers with a deadline are served one at a time,
//! earliest deadline first, and the others share what is left by score.
//! When a transfer finishes, the weights are computed again. Under
//! `fifo`, the whole link serves the oldest transfer. Nothing arrives,
//! no signal comes and no rate changes in the model.
//!
//! **Margin.** The dispatcher sends whole chunks, the rate cap's bucket
//! lets a round trip's worth of bytes ahead, a run waits a round trip for
//! its open's answer and one for its commit's, and a transfer is ready
//! when its last chunk has crossed. A deadline counts as met in the model only
//! with [`LinkScheduler::deadline_margin_ms`] to spare.
//!
//! **Slack.** At time `t`, in a class served at `R` bytes per ms (its
//! weight now, which with nothing arriving only grows as other classes
//! empty), the deadline transfers in EDF order `1..n` with bytes left
//! `b_j` have slack `s_i = d_i - t - (b_1 + ... + b_i) / R`. A deadline is
//! *at risk* when its slack is below the margin. While none is, the class
//! is served by score. While one is, the class serves its earliest
//! deadline first: every `s_i` then stays put or grows, so a deadline
//! whose slack was at least the margin is met; and one admitted with less
//! is served as the fluid model served it.

use std::collections::BTreeMap;

use ferry_proto::state::TransferId;
use serde::Serialize;

use crate::link::{ci, CLASSES};
use crate::{Class, LinkScheduler, PolicyKind, Transfer};

/// The answer to a transfer given a deadline: whether the fluid model has
/// it ready in time at the current queue and rates.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Admission {
    /// True if the model has it ready at least the margin before its
    /// deadline and no other transfer's deadline that was met stops being
    /// met because of it.
    pub feasible: bool,
    /// Its deadline, Unix ms.
    pub deadline_ms: i64,
    /// When the model has it ready, Unix ms.
    pub eta_ms: i64,
    /// The margin the model keeps before a deadline, ms
    /// ([`LinkScheduler::deadline_margin_ms`]).
    pub margin_ms: i64,
    /// Transfers whose deadlines the model met without this one and
    /// misses with it.
    #[schema(value_type = Vec<u64>)]
    pub endangers: Vec<TransferId>,
    /// When it is not ready in time in its class: the lowest higher class
    /// in which it would be (`None` if none would, or it is in time).
    pub class_needed: Option<Class>,
    /// When no class has it ready in time: the bytes over budget, that is
    /// what its class would have to carry in the time it would be late,
    /// in the highest class, bytes.
    pub bytes_over: Option<u64>,
}

/// One transfer in the fluid model.
#[derive(Debug, Clone)]
struct Fluid {
    id: TransferId,
    class: Class,
    deadline: Option<i64>,
    score: f64,
    created: i64,
    left: f64,
}

impl LinkScheduler {
    /// The margin kept before a deadline in class `class` when the link
    /// is shared as now by transfers of `busy` classes, ms: three round
    /// trips (the open's and the commit's answers, and the last chunk
    /// crossing), plus a bucket of bytes and three chunks at the class's
    /// rate (a chunk waiting behind another class's, the chunk being sent,
    /// and the last one), plus the time the sink takes from the last byte
    /// to the publish ([`LinkScheduler::set_finish_ms`]: the agent gives
    /// it from its recent publishes). `i64::MAX` if the class gets no
    /// rate.
    pub fn deadline_margin_ms(&self, class: Class, busy: [bool; 3]) -> i64 {
        let w = if self.policy().kind == PolicyKind::Fifo {
            1.0
        } else {
            let mut b = busy;
            b[ci(class)] = true;
            self.class_weights(b)[ci(class)]
        };
        let rate = w * self.bytes_per_ms();
        if rate <= 0.0 {
            return i64::MAX;
        }
        let chunk = self.chunk_bytes() as f64;
        let bytes = self.capacity().max(chunk) + 3.0 * chunk;
        (3 * self.rtt_ms() as i64 + (bytes / rate).ceil() as i64).saturating_add(self.finish_ms())
    }

    /// The fluid model's ready time of each of `ts` (Unix ms), from
    /// `now_ms` at the current rate cap (see the module's documentation).
    /// Scores are taken at `now_ms`. A transfer with nothing left is
    /// ready at `now_ms`.
    pub fn fluid_eta(&self, ts: &[Transfer], now_ms: i64) -> BTreeMap<TransferId, i64> {
        let mut fl: Vec<Fluid> = ts
            .iter()
            .map(|t| Fluid {
                id: t.id,
                class: t.class,
                deadline: t.deadline_ms,
                score: self.score_now(t, now_ms).max(1e-9),
                created: t.created_ms,
                left: t.bytes_left as f64,
            })
            .collect();
        let rate = self.bytes_per_ms();
        let mut out = BTreeMap::new();
        let mut t = now_ms as f64;
        loop {
            for f in fl.iter().filter(|f| f.left <= 0.0) {
                out.insert(f.id, t.ceil() as i64);
            }
            fl.retain(|f| f.left > 0.0);
            if fl.is_empty() {
                return out;
            }
            // Each transfer's rate now, bytes per ms.
            let mut r = vec![0.0; fl.len()];
            if self.policy().kind == PolicyKind::Fifo {
                let (i, _) = fl
                    .iter()
                    .enumerate()
                    .min_by_key(|(_, f)| (f.created, f.id))
                    .expect("fl is not empty");
                r[i] = rate;
            } else {
                let mut busy = [false; 3];
                for f in &fl {
                    busy[ci(f.class)] = true;
                }
                let w = self.class_weights(busy);
                for c in CLASSES {
                    let rc = w[ci(c)] * rate;
                    let edf = fl
                        .iter()
                        .enumerate()
                        .filter(|(_, f)| f.class == c && f.deadline.is_some())
                        .min_by_key(|(_, f)| (f.deadline, f.created, f.id));
                    if let Some((i, _)) = edf {
                        r[i] = rc;
                        continue;
                    }
                    let sum: f64 = fl.iter().filter(|f| f.class == c).map(|f| f.score).sum();
                    for (i, f) in fl.iter().enumerate().filter(|(_, f)| f.class == c) {
                        r[i] = rc * f.score / sum.max(f64::MIN_POSITIVE);
                    }
                }
            }
            // Until the next transfer finishes.
            let dt = fl
                .iter()
                .zip(&r)
                .filter(|(_, r)| **r > 0.0)
                .map(|(f, r)| f.left / r)
                .fold(f64::INFINITY, f64::min);
            if !dt.is_finite() {
                // A class with no rate (floor 0 under a busy higher class
                // that never empties cannot happen: classes above it
                // empty). Nothing moves: the rest is never ready.
                for f in &fl {
                    out.insert(f.id, i64::MAX);
                }
                return out;
            }
            t += dt;
            for (f, r) in fl.iter_mut().zip(&r) {
                f.left -= r * dt;
                // Rounding: what is within a byte of done is done.
                if f.left < 0.5 {
                    f.left = 0.0;
                }
            }
        }
    }

    /// The admission answer for `candidate` (which must have a deadline;
    /// `None` otherwise) when the link's other transfers are its active
    /// ones, `queued` (waiting here) and `elsewhere` (run by other agents
    /// of a pool): see [`Admission`]. A transfer in several of these lists
    /// counts once, the candidate's own entry replacing any other.
    pub fn admission(
        &self,
        candidate: &Transfer,
        queued: &[Transfer],
        elsewhere: &[Transfer],
        now_ms: i64,
    ) -> Option<Admission> {
        let deadline = candidate.deadline_ms?;
        let mut others: BTreeMap<TransferId, Transfer> = BTreeMap::new();
        for t in self.active_transfers().chain(queued).chain(elsewhere) {
            if t.id != candidate.id {
                others.entry(t.id).or_insert_with(|| t.clone());
            }
        }
        let others: Vec<Transfer> = others.into_values().collect();
        let busy_with = |extra: &Transfer| {
            let mut busy = [false; 3];
            for t in others.iter().chain(std::iter::once(extra)) {
                if t.bytes_left > 0 {
                    busy[ci(t.class)] = true;
                }
            }
            busy
        };
        let met = |etas: &BTreeMap<TransferId, i64>, t: &Transfer, busy: [bool; 3]| match (
            t.deadline_ms,
            etas.get(&t.id),
        ) {
            (Some(d), Some(&e)) => e.saturating_add(self.deadline_margin_ms(t.class, busy)) <= d,
            _ => true,
        };
        // Without the candidate: which deadlines are met now.
        let before = self.fluid_eta(&others, now_ms);
        let mut busy0 = [false; 3];
        for t in others.iter().filter(|t| t.bytes_left > 0) {
            busy0[ci(t.class)] = true;
        }
        // In its class, and in each higher one.
        let run = |class: Class| {
            let mut c = candidate.clone();
            c.class = class;
            let mut all = others.clone();
            all.push(c.clone());
            let etas = self.fluid_eta(&all, now_ms);
            let busy = busy_with(&c);
            let eta = etas.get(&c.id).copied().unwrap_or(i64::MAX);
            let margin = self.deadline_margin_ms(class, busy);
            (etas, eta, margin, busy)
        };
        let (etas, eta, margin, busy) = run(candidate.class);
        let in_time = eta.saturating_add(margin) <= deadline;
        let endangers: Vec<TransferId> = others
            .iter()
            .filter(|t| t.deadline_ms.is_some())
            .filter(|t| met(&before, t, busy0) && !met(&etas, t, busy))
            .map(|t| t.id)
            .collect();
        let (mut class_needed, mut bytes_over) = (None, None);
        if !in_time && self.policy().kind == PolicyKind::Priority {
            let higher: Vec<Class> = CLASSES
                .iter()
                .rev()
                .copied()
                .filter(|c| *c < candidate.class)
                .collect();
            for c in &higher {
                let (_, e, m, _) = run(*c);
                if e.saturating_add(m) <= deadline {
                    class_needed = Some(*c);
                    break;
                }
            }
        }
        if !in_time && class_needed.is_none() {
            let top = if self.policy().kind == PolicyKind::Fifo {
                candidate.class
            } else {
                Class::Urgent
            };
            let (_, e, m, busy) = run(top);
            let w = if self.policy().kind == PolicyKind::Fifo {
                1.0
            } else {
                self.class_weights(busy)[ci(top)]
            };
            let late_ms = e.saturating_add(m).saturating_sub(deadline).max(0) as f64;
            bytes_over = Some((late_ms * w * self.bytes_per_ms()).ceil() as u64);
        }
        Some(Admission {
            feasible: in_time && endangers.is_empty(),
            deadline_ms: deadline,
            eta_ms: eta,
            margin_ms: margin,
            endangers,
            class_needed,
            bytes_over,
        })
    }

    /// Which of `ts` (transfers of one class `class`, active or not, as
    /// `(id, deadline, created, bytes left)`) must be served first at
    /// `now_ms`: those whose deadline is at risk (slack below the margin;
    /// see the module's documentation), with the class served at its
    /// weight when `busy` classes share the link, and every one ahead of
    /// them in earliest-deadline-first order. Empty if none is at risk.
    pub(crate) fn at_risk<'a>(
        &self,
        class: Class,
        busy: [bool; 3],
        ts: impl IntoIterator<Item = (&'a TransferId, i64, i64, u64)>,
        now_ms: i64,
    ) -> Vec<TransferId> {
        let mut d: Vec<(i64, i64, TransferId, u64)> = ts
            .into_iter()
            .map(|(id, deadline, created, left)| (deadline, created, *id, left))
            .collect();
        if d.is_empty() {
            return Vec::new();
        }
        d.sort();
        let mut b = busy;
        b[ci(class)] = true;
        let rate = self.class_weights(b)[ci(class)] * self.bytes_per_ms();
        let margin = self.deadline_margin_ms(class, busy);
        let mut cum = 0.0;
        let mut last = None;
        for (i, (deadline, _, _, left)) in d.iter().enumerate() {
            cum += *left as f64;
            let slack = if rate > 0.0 {
                *deadline as f64 - now_ms as f64 - cum / rate
            } else {
                f64::NEG_INFINITY
            };
            if slack < margin as f64 {
                last = Some(i);
            }
        }
        match last {
            Some(i) => d[..=i].iter().map(|x| x.2).collect(),
            None => Vec::new(),
        }
    }
}

/// What a job can expect from its link: the answer to a training
/// controller asking whether replication keeps up with its checkpoints
/// ([`LinkScheduler::outlook`]). Times are Unix ms, rates bit/s.
#[derive(Debug, Clone, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Outlook {
    /// Bytes of the job's own unfinished transfers on the link.
    pub backlog_bytes: u64,
    /// When the fluid model has the last of them ready (`None`: none).
    pub backlog_ready_ms: Option<i64>,
    /// The checkpoint size the answer plans with, bytes (the job's recent
    /// checkpoints).
    pub checkpoint_bytes: u64,
    /// Bytes the link carries for other transfers (and the job's backlog)
    /// before a checkpoint of the job committed now is ready.
    pub ahead_bytes: u64,
    /// When the fluid model has a checkpoint of the job committed now
    /// ready: its expected time to eval-ready (`None`: never, no rate).
    pub next_ready_ms: Option<i64>,
    /// The job's checkpoint interval the answer plans with, ms (`None`:
    /// not known yet, fewer than two checkpoints).
    pub cadence_ms: Option<i64>,
    /// The rate the next checkpoint gets on average until it is ready
    /// (its bytes over its time to ready), bit/s.
    pub carried_bps: u64,
    /// Whether one checkpoint per interval fits in what the job gets:
    /// its time to ready plus the deadline margin is at most the
    /// interval (`None` without a cadence).
    pub keeps_up: Option<bool>,
    /// When it does not: replicate every k-th checkpoint (the smallest
    /// k whose interval covers the time to ready plus the deadline
    /// margin, [`LinkScheduler::deadline_margin_ms`]).
    pub every_k: Option<u32>,
    /// When it does not: the rate cap of the link at which the job, with
    /// the same share, would carry one checkpoint per interval, bit/s.
    pub rate_needed_bps: Option<u64>,
}

impl LinkScheduler {
    /// The outlook of job `next.job` on this link at `now_ms`: `next` is
    /// a checkpoint of the job committed now (its class, importance and
    /// size as planned), `others` every other unfinished transfer of the
    /// link (the job's own included), `cadence_ms` the job's checkpoint
    /// interval if known. See [`Outlook`].
    pub fn outlook(
        &self,
        next: &Transfer,
        others: &[Transfer],
        cadence_ms: Option<i64>,
        now_ms: i64,
    ) -> Outlook {
        let own: Vec<&Transfer> = others.iter().filter(|t| t.job == next.job).collect();
        let backlog_bytes = own.iter().map(|t| t.bytes_left).sum();
        let mut all: Vec<Transfer> = others.iter().filter(|t| t.id != next.id).cloned().collect();
        let before = self.fluid_eta(&all, now_ms);
        let backlog_ready_ms = own
            .iter()
            .filter_map(|t| before.get(&t.id).copied())
            .max()
            .filter(|e| *e < i64::MAX);
        all.push(next.clone());
        let etas = self.fluid_eta(&all, now_ms);
        let next_ready_ms = etas.get(&next.id).copied().filter(|e| *e < i64::MAX);
        let rate = self.bytes_per_ms();
        let (ahead_bytes, carried_bps) = match next_ready_ms {
            Some(e) => {
                let dur = (e - now_ms).max(1) as f64;
                (
                    (rate * dur - next.bytes_left as f64).max(0.0) as u64,
                    (next.bytes_left as f64 * 8.0 * 1000.0 / dur) as u64,
                )
            }
            None => (0, 0),
        };
        let (mut keeps_up, mut every_k, mut rate_needed_bps) = (None, None, None);
        if let (Some(c), Some(e)) = (cadence_ms.filter(|c| *c > 0), next_ready_ms) {
            // With the margin a deadline keeps: a checkpoint is ready
            // before the next one is due.
            let mut busy = [false; 3];
            for t in &all {
                busy[ci(t.class)] = true;
            }
            let margin = self.deadline_margin_ms(next.class, busy);
            let dur = (e - now_ms).max(1).saturating_add(margin);
            let ok = dur <= c;
            keeps_up = Some(ok);
            if !ok {
                every_k = Some(u32::try_from((dur + c - 1) / c).unwrap_or(u32::MAX));
                let cap = self.rate_bps() as f64;
                rate_needed_bps = Some((cap * dur as f64 / c as f64).ceil() as u64);
            }
        }
        Outlook {
            backlog_bytes,
            backlog_ready_ms,
            checkpoint_bytes: next.bytes_left,
            ahead_bytes,
            next_ready_ms,
            cadence_ms,
            carried_bps,
            keeps_up,
            every_k,
            rate_needed_bps,
        }
    }
}
