//! One link's dispatcher: which ready chunk goes next, with what QUIC
//! stream priority, under the link's rate cap.
//!
//! Two levels of start-time fair queuing (SFQ): classes share the link by
//! class weight, transfers within a class by score. A chunk of `b` bytes
//! advances its class's tag by `b / class weight` and its transfer's tag
//! by `b / score`; the smallest tag goes next (ties: the higher class, the
//! higher score, the older transfer). A class or transfer that becomes
//! ready starts at the current virtual time (the tag of the last chunk
//! sent), never earlier than where it stopped, so idling earns no credit;
//! a class that becomes ready while only lower classes are ready starts
//! at the virtual time, so it is served at the very next decision
//! (pre-emption).
//!
//! Class weights while several classes are ready: each lower ready class
//! gets its floor, the highest ready class the rest (defaults: urgent
//! 0.85 with scheduled 0.10 and background 0.05). A class whose floor is 0
//! is served only when no higher class is ready.
//!
//! The rate cap is a token bucket in payload bytes: it fills at the cap
//! (bit/s / 8) up to `max(BDP, largest chunk)` bytes plus one millisecond
//! of the cap (waits are whole milliseconds; the extra keeps a wait's
//! rounding from losing tokens, which at a chunk of a few milliseconds
//! would cost several percent of the rate), and a chunk needs its length
//! in tokens (a chunk longer than the bucket needs a full one). So over
//! any window of `W` seconds, bytes dispatched are at most
//! `cap x W + max(BDP, largest chunk) + cap x 1 ms`. An urgent chunk needs
//! only a bucket not in debt and borrows its length (the next chunks wait
//! until it is repaid): the first urgent chunk after a signal leaves at
//! once instead of after one chunk's time at the cap, and the bound grows
//! by the largest urgent chunk.

use std::collections::{BTreeMap, HashMap, VecDeque};

use ferry_proto::state::TransferId;
use serde::Serialize;

use crate::score::{score, severity, Score, ScoreInputs};
use crate::{Class, Policy, PolicyKind};

/// How often a transfer's score is recomputed (aging and severity decay
/// move slowly), ms.
pub const SCORE_REFRESH_MS: i64 = 1_000;

/// The chunk length deadline margins assume until the dispatcher has seen
/// a longer one, bytes: the agents' default `[source] chunk_size` (4 MiB).
pub const DEFAULT_CHUNK_BYTES: u64 = 4 << 20;

/// Signals whose decayed severity falls below this are forgotten.
const SEVERITY_FLOOR: f64 = 1e-3;

/// A transfer as the scheduler sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Transfer {
    /// Transfer id.
    pub id: TransferId,
    /// Effective class (see [`crate::effective_class`]).
    pub class: Class,
    /// Job name (its signals raise the score).
    pub job: String,
    /// Model parameters of the job, if known.
    pub model_params: Option<f64>,
    /// Importance 0..1 (the transfer's override, else the job's).
    pub importance: f64,
    /// Bytes not yet sent, for shares and ETAs.
    pub bytes_left: u64,
    /// When it was queued, Unix ms (aging; first come, first served).
    pub created_ms: i64,
    /// Whether `bytes_left` is final: the transfer's size is known and
    /// will not grow (a pushed directory once listed, a committed
    /// checkpoint). Only such a transfer can be small
    /// ([`crate::Policy::small_bytes`]).
    pub size_final: bool,
    /// When it should be ready, Unix ms, if a client gave a deadline
    /// (see [`crate::deadline`]).
    pub deadline_ms: Option<i64>,
}

impl Transfer {
    /// Whether it is a small transfer under `policy`: its size is final and
    /// at most [`crate::Policy::small_bytes`] are left to send. Small
    /// transfers do not count against `max_active`.
    pub fn is_small(&self, policy: &Policy) -> bool {
        policy.max_small_active > 0 && self.size_final && self.bytes_left <= policy.small_bytes
    }
}

/// What to do next on the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Send the oldest ready chunk of transfer `id` (`bytes` long) on a
    /// stream of that transfer with QUIC stream `priority` (higher first).
    Send {
        /// Transfer id.
        id: TransferId,
        /// Length of the chunk, bytes.
        bytes: u64,
        /// QUIC stream priority: 2 urgent, 1 scheduled, 0 background
        /// (all 0 under `fifo`).
        priority: i32,
    },
    /// A chunk is ready but the rate cap says wait until this time (Unix
    /// ms).
    Wait {
        /// Earliest time to ask again, Unix ms.
        until_ms: i64,
    },
    /// No chunk is ready.
    Idle,
}

/// The QUIC stream priority of a class (higher is sent first).
pub fn priority(class: Class) -> i32 {
    match class {
        Class::Urgent => 2,
        Class::Scheduled => 1,
        Class::Background => 0,
    }
}

/// Why a transfer gets the share it gets.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Explanation {
    /// Effective class.
    pub class: Class,
    /// Score and terms.
    pub score: Score,
    /// The weight of its class on the link now, 0..1.
    pub class_weight: f64,
    /// Its expected share of the link now, 0..1 (class weight x score /
    /// sum of scores of the active transfers in its class).
    pub share: f64,
    /// The live severity of its job's signals, 0..1.
    pub severity: f64,
    /// Bytes left divided by share x rate cap, seconds (`None` with no
    /// share).
    pub eta_s: Option<f64>,
}

struct Entry {
    t: Transfer,
    /// Lengths of the ready chunks, oldest first.
    ready: VecDeque<u64>,
    /// Start tag (virtual bytes) of its next chunk.
    tag: f64,
    was_ready: bool,
    score: Score,
    scored_at: i64,
}

pub(crate) const CLASSES: [Class; 3] = [Class::Urgent, Class::Scheduled, Class::Background];

pub(crate) fn ci(c: Class) -> usize {
    match c {
        Class::Urgent => 0,
        Class::Scheduled => 1,
        Class::Background => 2,
    }
}

/// An agent's part of its pool's budget on one link
/// ([`LinkScheduler::pool_share`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolShare {
    /// The fraction of the link's rate cap this agent is due, 0..1
    /// ([`LinkScheduler::pool_fraction_split`]).
    pub fraction: f64,
    /// By class (urgent, scheduled, background): for each class below the
    /// highest class busy anywhere in the pool, the fraction of the link's
    /// rate cap this agent's transfers of that class are due, 0..1 (0 when
    /// it runs none); `None` for the highest busy class and the classes
    /// above it, which may use whatever of `fraction` the capped classes
    /// leave. Under `fifo`, all `None`.
    pub class_caps: [Option<f64>; 3],
}

/// Token bucket in payload bytes.
#[derive(Debug, Clone)]
struct Bucket {
    rate_bps: u64,
    rtt_ms: u64,
    tokens: f64,
    at_ms: i64,
}

impl Bucket {
    fn bytes_per_ms(&self) -> f64 {
        self.rate_bps as f64 / 8.0 / 1000.0
    }
    fn bdp(&self) -> f64 {
        self.bytes_per_ms() * self.rtt_ms as f64
    }
    fn refill(&mut self, now: i64, cap: f64) {
        if now > self.at_ms {
            let add = (now - self.at_ms) as f64 * self.bytes_per_ms();
            self.tokens = (self.tokens + add).min(cap);
            self.at_ms = now;
        }
    }
}

/// The scheduler of one link: active transfers, their ready chunks, the
/// rate cap and the jobs' live signals. Feed it events; ask [`next`].
///
/// [`next`]: LinkScheduler::next
pub struct LinkScheduler {
    policy: Policy,
    bucket: Bucket,
    /// Largest chunk seen, bytes (the bucket holds at least one).
    max_chunk: u64,
    /// The chunk length the deadline margin assumes, bytes (see
    /// [`LinkScheduler::set_chunk_bytes`]).
    chunk_hint: u64,
    /// The time from a transfer's last byte to its publish the deadline
    /// margin adds, ms (see [`LinkScheduler::set_finish_ms`]).
    finish_ms: i64,
    entries: BTreeMap<TransferId, Entry>,
    signals: HashMap<String, Vec<(f64, i64)>>,
    class_tag: [f64; 3],
    class_was_ready: [bool; 3],
    /// Virtual time between classes: the class tag of the last chunk sent.
    v_link: f64,
    /// Virtual time within each class.
    v_class: [f64; 3],
    /// Rate caps of single classes below the link's, by class index
    /// (see [`LinkScheduler::set_class_rates`]); `None`: the class may use
    /// the whole link rate.
    class_caps: [Option<Bucket>; 3],
}

impl std::fmt::Debug for LinkScheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkScheduler")
            .field("transfers", &self.entries.len())
            .field("rate_bps", &self.bucket.rate_bps)
            .finish()
    }
}

impl LinkScheduler {
    /// A link with rate cap `rate_bps` (bit/s, at least 1) and base RTT
    /// `rtt_ms`, at time `now_ms` (Unix ms); the bucket starts full.
    pub fn new(policy: Policy, rate_bps: u64, rtt_ms: u64, now_ms: i64) -> LinkScheduler {
        let mut bucket = Bucket {
            rate_bps: rate_bps.max(1),
            rtt_ms: rtt_ms.max(1),
            tokens: 0.0,
            at_ms: now_ms,
        };
        bucket.tokens = bucket.bdp();
        LinkScheduler {
            policy,
            bucket,
            max_chunk: 0,
            chunk_hint: DEFAULT_CHUNK_BYTES,
            finish_ms: 0,
            entries: BTreeMap::new(),
            signals: HashMap::new(),
            class_tag: [0.0; 3],
            class_was_ready: [false; 3],
            v_link: 0.0,
            v_class: [0.0; 3],
            class_caps: [None, None, None],
        }
    }

    /// The policy.
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Replaces the policy (a pool's shared `[scheduler]` changed): every
    /// active transfer's score is computed again under it at the next
    /// decision; ready chunks, signals and the rate cap are kept.
    pub fn set_policy(&mut self, policy: Policy) {
        self.policy = policy;
        for e in self.entries.values_mut() {
            e.scored_at = i64::MIN;
        }
    }

    /// The rate cap, bit/s.
    pub fn rate_bps(&self) -> u64 {
        self.bucket.rate_bps
    }

    /// Bucket size in bytes: `max(BDP, largest chunk)`.
    pub(crate) fn capacity(&self) -> f64 {
        self.bucket.bdp().max(self.max_chunk as f64)
    }

    /// The rate cap in bytes per millisecond.
    pub(crate) fn bytes_per_ms(&self) -> f64 {
        self.bucket.bytes_per_ms()
    }

    /// The base RTT, ms (at least 1).
    pub(crate) fn rtt_ms(&self) -> u64 {
        self.bucket.rtt_ms
    }

    /// The chunk length deadlines are planned with: the larger of the
    /// hint ([`LinkScheduler::set_chunk_bytes`]) and the largest chunk
    /// seen, bytes.
    pub(crate) fn chunk_bytes(&self) -> u64 {
        self.chunk_hint.max(self.max_chunk)
    }

    /// Tells the scheduler the chunk length its senders use, bytes (the
    /// agent's `[source] chunk_size`; default
    /// [`DEFAULT_CHUNK_BYTES`]), so deadline margins are
    /// right before the first chunk is seen.
    pub fn set_chunk_bytes(&mut self, bytes: u64) {
        self.chunk_hint = bytes.max(1);
    }

    /// Tells the scheduler how long a transfer takes from its last byte
    /// to its publish at the sink (verification, read-back, publish), ms;
    /// the deadline margin adds it. Default 0; negative counts as 0.
    pub fn set_finish_ms(&mut self, ms: i64) {
        self.finish_ms = ms.max(0);
    }

    /// The time from last byte to publish the margin adds, ms.
    pub fn finish_ms(&self) -> i64 {
        self.finish_ms
    }

    /// The active transfers as last given (bytes left as sent so far).
    pub(crate) fn active_transfers(&self) -> impl Iterator<Item = &Transfer> {
        self.entries.values().map(|e| &e.t)
    }

    /// `t`'s score value at `now_ms` under this link's policy and signals.
    pub(crate) fn score_now(&self, t: &Transfer, now_ms: i64) -> f64 {
        self.score_of(t, now_ms).value
    }

    /// Changes the rate cap (bit/s, at least 1) from `now_ms` on; tokens
    /// already earned are kept up to the new bucket size.
    pub fn set_rate(&mut self, rate_bps: u64, now_ms: i64) {
        let cap = self.capacity();
        self.bucket.refill(now_ms, cap);
        self.bucket.rate_bps = rate_bps.max(1);
        self.bucket.tokens = self.bucket.tokens.min(self.capacity());
    }

    /// Caps single classes below the link's rate from `now_ms` on: by class
    /// (urgent, scheduled, background), `Some(bit/s)` (at least 1) holds
    /// the class's chunks to that rate even while no other class has a
    /// chunk ready (not work-conserving); `None` lets the class use the
    /// whole link rate, shared by the class rules (the default).
    ///
    /// A pool uses this to hold the classes below the highest class busy
    /// anywhere in the pool to their due share at each agent
    /// ([`PoolShare::class_caps`]): an agent due an urgent share does not
    /// fill it with background chunks while its urgent chunks are not
    /// ready yet. A class newly capped starts one chunk in debt (the
    /// link's chunk length, [`LinkScheduler::set_chunk_bytes`]), so it
    /// slows at once; a changed cap keeps the class's tokens and debt.
    /// Under `fifo` the caps are kept but not applied.
    pub fn set_class_rates(&mut self, rates: [Option<u64>; 3], now_ms: i64) {
        let rtt_ms = self.bucket.rtt_ms;
        let chunk = self.chunk_bytes() as f64;
        for (slot, rate) in self.class_caps.iter_mut().zip(rates) {
            match (slot.as_mut(), rate) {
                (_, None) => *slot = None,
                (Some(b), Some(r)) => {
                    let full = (b.bdp().max(chunk)) + b.bytes_per_ms();
                    b.refill(now_ms, full);
                    b.rate_bps = r.max(1);
                }
                (None, Some(r)) => {
                    *slot = Some(Bucket {
                        rate_bps: r.max(1),
                        rtt_ms,
                        tokens: -chunk,
                        at_ms: now_ms,
                    })
                }
            }
        }
    }

    /// The class rate caps set by [`LinkScheduler::set_class_rates`],
    /// bit/s, by class (urgent, scheduled, background).
    pub fn class_rates(&self) -> [Option<u64>; 3] {
        self.class_caps
            .each_ref()
            .map(|b| b.as_ref().map(|b| b.rate_bps))
    }

    /// Adds a transfer (now active on the link) or updates its class,
    /// importance, size or bytes left; ready chunks are kept.
    pub fn upsert(&mut self, t: Transfer, now_ms: i64) {
        let sc = self.score_of(&t, now_ms);
        match self.entries.get_mut(&t.id) {
            Some(e) => {
                e.t = t;
                e.score = sc;
                e.scored_at = now_ms;
            }
            None => {
                self.entries.insert(
                    t.id,
                    Entry {
                        t,
                        ready: VecDeque::new(),
                        tag: 0.0,
                        was_ready: false,
                        score: sc,
                        scored_at: now_ms,
                    },
                );
            }
        }
    }

    /// Removes a transfer (done, paused, cancelled); its ready chunks are
    /// forgotten.
    pub fn remove(&mut self, id: TransferId) {
        self.entries.remove(&id);
    }

    /// Forgets the ready chunks of `id` (its sender restarted).
    pub fn clear_ready(&mut self, id: TransferId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.ready.clear();
        }
    }

    /// True if `id` is active on this link.
    pub fn contains(&self, id: TransferId) -> bool {
        self.entries.contains_key(&id)
    }

    /// The class active transfer `id` is served in now (as last given to
    /// [`LinkScheduler::upsert`]); `None` if it is not active.
    pub fn class_of(&self, id: TransferId) -> Option<Class> {
        self.entries.get(&id).map(|e| e.t.class)
    }

    /// Ids of the active transfers.
    pub fn active(&self) -> Vec<TransferId> {
        self.entries.keys().copied().collect()
    }

    /// A chunk of `bytes` of transfer `id` is ready to send (after the
    /// chunks already ready). Unknown ids are ignored.
    pub fn chunk_ready(&mut self, id: TransferId, bytes: u64) {
        self.max_chunk = self.max_chunk.max(bytes);
        if let Some(e) = self.entries.get_mut(&id) {
            e.ready.push_back(bytes);
        }
    }

    /// Records a signal of `severity` (0..1) for `job` received at
    /// `at_ms`: the job's score rises (decaying with the half-life).
    pub fn signal(&mut self, job: &str, severity: f64, at_ms: i64) {
        self.signals
            .entry(job.to_string())
            .or_default()
            .push((severity, at_ms));
        for e in self.entries.values_mut() {
            if e.t.job == job {
                e.scored_at = i64::MIN;
            }
        }
    }

    /// The live severity of `job` at `now_ms`, 0..1.
    pub fn severity(&self, job: &str, now_ms: i64) -> f64 {
        match self.signals.get(job) {
            Some(s) => severity(&self.policy, s.iter().copied(), now_ms),
            None => 0.0,
        }
    }

    fn score_of(&self, t: &Transfer, now_ms: i64) -> Score {
        score(
            &self.policy,
            ScoreInputs {
                model_params: t.model_params,
                importance: t.importance,
                severity: self.severity(&t.job, now_ms),
                waiting_ms: now_ms.saturating_sub(t.created_ms).max(0) as u64,
            },
        )
    }

    fn refresh_scores(&mut self, now_ms: i64) {
        let stale: Vec<TransferId> = self
            .entries
            .values()
            .filter(|e| {
                now_ms.saturating_sub(e.scored_at) >= SCORE_REFRESH_MS || e.scored_at > now_ms
            })
            .map(|e| e.t.id)
            .collect();
        if stale.is_empty() {
            return;
        }
        let half = self.policy.severity_half_life_ms.max(1) as f64;
        for list in self.signals.values_mut() {
            list.retain(|(s, at)| {
                s * 0.5f64.powf(now_ms.saturating_sub(*at).max(0) as f64 / half) >= SEVERITY_FLOOR
            });
        }
        self.signals.retain(|_, l| !l.is_empty());
        for id in stale {
            let Some(t) = self.entries.get(&id).map(|e| e.t.clone()) else {
                continue;
            };
            let sc = self.score_of(&t, now_ms);
            if let Some(e) = self.entries.get_mut(&id) {
                e.score = sc;
                e.scored_at = now_ms;
            }
        }
    }

    /// Weights of the classes given which are busy: each lower busy class
    /// its floor, the highest busy class the rest.
    pub(crate) fn class_weights(&self, busy: [bool; 3]) -> [f64; 3] {
        let mut w = [0.0; 3];
        let Some(top) = (0..3).find(|&i| busy[i]) else {
            return w;
        };
        let mut rest = 1.0;
        for i in top + 1..3 {
            if busy[i] {
                w[i] = self.policy.floors.of(CLASSES[i]);
                rest -= w[i];
            }
        }
        w[top] = rest.max(0.0);
        w
    }

    /// The expected share of the link of every active transfer now
    /// (class weight x score / sum of scores in its class, with every
    /// class that has an active transfer counted as busy), 0..1. Under
    /// `fifo` the oldest transfer has 1.
    pub fn shares(&self) -> Vec<(TransferId, f64)> {
        if self.policy.kind == PolicyKind::Fifo {
            let oldest = self
                .entries
                .values()
                .min_by_key(|e| (e.t.created_ms, e.t.id))
                .map(|e| e.t.id);
            return self
                .entries
                .keys()
                .map(|&id| (id, if Some(id) == oldest { 1.0 } else { 0.0 }))
                .collect();
        }
        let mut busy = [false; 3];
        let mut sums = [0.0; 3];
        for e in self.entries.values() {
            busy[ci(e.t.class)] = true;
            sums[ci(e.t.class)] += e.score.value;
        }
        let w = self.class_weights(busy);
        self.entries
            .values()
            .map(|e| {
                let c = ci(e.t.class);
                (
                    e.t.id,
                    w[c] * e.score.value / sums[c].max(f64::MIN_POSITIVE),
                )
            })
            .collect()
    }

    /// Explains the rank of active transfer `id` (`None` if not active).
    pub fn explain(&self, id: TransferId, now_ms: i64) -> Option<Explanation> {
        let e = self.entries.get(&id)?;
        let share = self
            .shares()
            .into_iter()
            .find(|(i, _)| *i == id)
            .map_or(0.0, |(_, s)| s);
        let mut busy = [false; 3];
        for o in self.entries.values() {
            busy[ci(o.t.class)] = true;
        }
        let rate = self.bucket.rate_bps as f64 / 8.0;
        Some(Explanation {
            class: e.t.class,
            score: self.score_of(&e.t, now_ms),
            class_weight: self.class_weights(busy)[ci(e.t.class)],
            share,
            severity: self.severity(&e.t.job, now_ms),
            eta_s: (share > 0.0).then(|| e.t.bytes_left as f64 / (share * rate)),
        })
    }

    /// Decides what goes next at `now_ms` and, for [`Decision::Send`],
    /// commits to it: the chunk leaves the ready list and its bytes the
    /// bucket. The caller must send that chunk.
    pub fn next(&mut self, now_ms: i64) -> Decision {
        self.refresh_scores(now_ms);
        let cap = self.capacity();
        let full = cap + self.bucket.bytes_per_ms();
        self.bucket.refill(now_ms, full);
        // Classes held back by their own cap now (ready or not), and when
        // each may send again.
        let chunk = self.chunk_bytes() as f64;
        let mut held: [Option<i64>; 3] = [None; 3];
        if self.policy.kind == PolicyKind::Priority {
            for (i, b) in self.class_caps.iter_mut().enumerate() {
                let Some(b) = b else { continue };
                let full = b.bdp().max(chunk) + b.bytes_per_ms();
                b.refill(now_ms, full);
                if b.tokens < 0.0 {
                    let wait_ms = (-b.tokens / b.bytes_per_ms()).ceil();
                    held[i] = Some(now_ms.saturating_add((wait_ms as i64).max(1)));
                }
            }
        }
        let pick = match self.policy.kind {
            PolicyKind::Fifo => self.pick_fifo(),
            PolicyKind::Priority => self.pick_priority(now_ms, held),
        };
        let Some((id, class_w, by_deadline)) = pick else {
            // Chunks held back by their class's cap: wait for the first
            // class that may send again.
            let until = self
                .entries
                .values()
                .filter(|e| !e.ready.is_empty())
                .filter_map(|e| held[ci(e.t.class)])
                .min();
            if let Some(until_ms) = until {
                return Decision::Wait { until_ms };
            }
            // Nothing ready: restart virtual time so tags stay small.
            self.class_tag = [0.0; 3];
            self.v_link = 0.0;
            self.v_class = [0.0; 3];
            for e in self.entries.values_mut() {
                e.tag = 0.0;
                e.was_ready = false;
            }
            self.class_was_ready = [false; 3];
            return Decision::Idle;
        };
        let Some(e) = self.entries.get_mut(&id) else {
            return Decision::Idle;
        };
        let bytes = e.ready.front().copied().unwrap_or(0);
        // An urgent chunk borrows its length from a bucket not in debt:
        // after a signal it leaves at once rather than after a chunk's
        // time at the rate (a third of a second for 4 MiB at 100 Mbit/s),
        // and the chunks after it repay the debt.
        let need = if e.t.class == Class::Urgent {
            0.0
        } else {
            (bytes as f64).min(cap)
        };
        if self.bucket.tokens < need {
            let wait_ms = ((need - self.bucket.tokens) / self.bucket.bytes_per_ms()).ceil();
            return Decision::Wait {
                until_ms: now_ms + (wait_ms as i64).max(1),
            };
        }
        self.bucket.tokens -= bytes as f64;
        e.ready.pop_front();
        let c = ci(e.t.class);
        if let Some(b) = self.class_caps[c].as_mut() {
            b.tokens -= bytes as f64;
        }
        let b = bytes.max(1) as f64;
        // A chunk sent for a deadline does not move the class's virtual
        // time: transfers that become ready are not pushed behind it.
        if !by_deadline {
            self.v_class[c] = e.tag;
        }
        e.tag += b / e.score.value.max(1e-9);
        e.t.bytes_left = e.t.bytes_left.saturating_sub(bytes);
        let class = e.t.class;
        if class_w > 0.0 {
            self.v_link = self.class_tag[c];
            self.class_tag[c] += b / class_w;
        }
        Decision::Send {
            id,
            bytes,
            priority: match self.policy.kind {
                PolicyKind::Fifo => 0,
                PolicyKind::Priority => priority(class),
            },
        }
    }

    fn pick_fifo(&self) -> Option<(TransferId, f64, bool)> {
        self.entries
            .values()
            .filter(|e| !e.ready.is_empty())
            .min_by_key(|e| (e.t.created_ms, e.t.id))
            .map(|e| (e.t.id, 0.0, false))
    }

    /// The transfer to serve in `class` earliest-deadline-first, if a
    /// deadline of the class is at risk (see [`crate::deadline`]): the
    /// ready one with the earliest deadline.
    fn pick_deadline(&self, class: usize, now_ms: i64) -> Option<TransferId> {
        if !self.policy.deadline_first {
            return None;
        }
        let in_class = || {
            self.entries
                .values()
                .filter(move |e| ci(e.t.class) == class && e.t.deadline_ms.is_some())
        };
        in_class().next()?;
        let mut busy = [false; 3];
        for e in self.entries.values() {
            busy[ci(e.t.class)] = true;
        }
        let risk = self.at_risk(
            CLASSES[class],
            busy,
            in_class().map(|e| {
                (
                    &e.t.id,
                    e.t.deadline_ms.unwrap_or(i64::MAX),
                    e.t.created_ms,
                    e.t.bytes_left,
                )
            }),
            now_ms,
        );
        if risk.is_empty() {
            return None;
        }
        in_class()
            .filter(|e| !e.ready.is_empty())
            .min_by_key(|e| (e.t.deadline_ms, e.t.created_ms, e.t.id))
            .map(|e| e.t.id)
    }

    /// The class and transfer to serve next under `priority`, among the
    /// classes with ready chunks not `held` back by their own cap.
    fn pick_priority(
        &mut self,
        now_ms: i64,
        held: [Option<i64>; 3],
    ) -> Option<(TransferId, f64, bool)> {
        let mut busy = [false; 3];
        for e in self.entries.values() {
            if !e.ready.is_empty() && held[ci(e.t.class)].is_none() {
                busy[ci(e.t.class)] = true;
            }
        }
        let top = (0..3).find(|&i| busy[i])?;
        // Classes that just became ready start at the virtual time; one
        // above every other ready class goes first.
        for i in 0..3 {
            if busy[i] && !self.class_was_ready[i] {
                let above_all = i == top && (i + 1..3).any(|j| busy[j]);
                self.class_tag[i] = if above_all {
                    self.v_link
                } else {
                    self.class_tag[i].max(self.v_link)
                };
            }
        }
        self.class_was_ready = busy;
        let w = self.class_weights(busy);
        let class = (0..3)
            .filter(|&i| busy[i] && (w[i] > 0.0 || i == top))
            .min_by(|&a, &b| {
                self.class_tag[a]
                    .total_cmp(&self.class_tag[b])
                    .then(a.cmp(&b))
            })?;
        // Transfers of that class that just became ready start at the
        // class's virtual time.
        let v = self.v_class[class];
        let deadline = self.pick_deadline(class, now_ms);
        for e in self.entries.values_mut() {
            let ready = !e.ready.is_empty();
            if ready && !e.was_ready && ci(e.t.class) == class {
                e.tag = e.tag.max(v);
            }
            if ci(e.t.class) == class || !ready {
                e.was_ready = ready;
            }
        }
        if let Some(id) = deadline {
            return Some((id, w[class], true));
        }
        let e = self
            .entries
            .values()
            .filter(|e| !e.ready.is_empty() && ci(e.t.class) == class)
            .min_by(|a, b| {
                a.tag
                    .total_cmp(&b.tag)
                    .then(b.score.value.total_cmp(&a.score.value))
                    .then((a.t.created_ms, a.t.id).cmp(&(b.t.created_ms, b.t.id)))
            })?;
        Some((e.t.id, w[class], false))
    }

    /// In a pool of agents sharing this link: the fraction of the link's
    /// rate cap this agent's active transfers are due, 0..1, when
    /// `elsewhere` are the link's transfers other agents run now. The
    /// class rules hold pool wide: every class with an active transfer
    /// anywhere is busy (the highest busy class gets the rest, each lower
    /// busy class its floor), and a class's weight is split among all its
    /// active transfers in proportion to their scores, wherever they run.
    /// This agent's fraction is the sum over its own. 1 when nothing runs
    /// elsewhere (a single agent keeps the whole link). Under `fifo`, 1
    /// if the oldest active transfer of the pool is here, else 0.
    pub fn pool_fraction(&self, elsewhere: &[Transfer], now_ms: i64) -> f64 {
        self.pool_fraction_split(elsewhere, &HashMap::new(), now_ms)
    }

    /// [`LinkScheduler::pool_fraction`] when some of this agent's active
    /// transfers are sent by several agents at once (a transfer striped
    /// into parts): `split` gives, per such transfer, the portion of its
    /// share that is this agent's, 0..1 (1 over the number of agents
    /// holding its parts, 0 if this agent holds none of them now);
    /// transfers it does not name count whole. With a split, the fraction
    /// is computed even when nothing else runs elsewhere.
    pub fn pool_fraction_split(
        &self,
        elsewhere: &[Transfer],
        split: &HashMap<TransferId, f64>,
        now_ms: i64,
    ) -> f64 {
        self.pool_share(elsewhere, split, now_ms).fraction
    }

    /// [`LinkScheduler::pool_fraction_split`] with the part of it each
    /// class is due, for [`LinkScheduler::set_class_rates`].
    pub fn pool_share(
        &self,
        elsewhere: &[Transfer],
        split: &HashMap<TransferId, f64>,
        now_ms: i64,
    ) -> PoolShare {
        let whole = PoolShare {
            fraction: 1.0,
            class_caps: [None; 3],
        };
        if elsewhere.is_empty() && split.is_empty() {
            return whole;
        }
        if self.entries.is_empty() {
            return PoolShare {
                fraction: 0.0,
                class_caps: [None; 3],
            };
        }
        let mine = self.entries.values().map(|e| (&e.t, e.score.value));
        let others: Vec<(&Transfer, f64)> = elsewhere
            .iter()
            .filter(|t| !self.entries.contains_key(&t.id))
            .map(|t| (t, self.score_of(t, now_ms).value))
            .collect();
        if self.policy.kind == PolicyKind::Fifo {
            let oldest_mine = self
                .entries
                .values()
                .map(|e| (e.t.created_ms, e.t.id))
                .min();
            let oldest_other = others.iter().map(|(t, _)| (t.created_ms, t.id)).min();
            return match (oldest_mine, oldest_other) {
                (Some(m), Some(o)) if o < m => PoolShare {
                    fraction: 0.0,
                    class_caps: [None; 3],
                },
                _ => whole,
            };
        }
        let mut busy = [false; 3];
        let mut sums = [0.0; 3];
        for (t, sc) in mine.clone().chain(others.iter().copied()) {
            busy[ci(t.class)] = true;
            sums[ci(t.class)] += sc;
        }
        let w = self.class_weights(busy);
        let mut by_class = [0.0; 3];
        for (t, sc) in mine {
            let c = ci(t.class);
            let portion = split.get(&t.id).copied().unwrap_or(1.0).clamp(0.0, 1.0);
            by_class[c] += portion * w[c] * sc / sums[c].max(f64::MIN_POSITIVE);
        }
        let top = busy.iter().position(|&b| b).unwrap_or(0);
        let mut class_caps = [None; 3];
        for (c, cap) in class_caps.iter_mut().enumerate().skip(top + 1) {
            *cap = Some(by_class[c].clamp(0.0, 1.0));
        }
        PoolShare {
            fraction: by_class.iter().sum::<f64>().clamp(0.0, 1.0),
            class_caps,
        }
    }

    /// Which of `waiting` (queued transfers of this link, not active) to
    /// start now, best first. Under `priority`: per class, up to
    /// `max_active` active at once; within a class, transfers that have
    /// waited `aging x (aging_cap - 1)` or longer (their aging term is at
    /// its cap) go first, oldest first, then the highest score, then the
    /// oldest (with `aging_cap` 1 there is no overdue rule). Under `fifo`:
    /// the oldest, up to `max_active` active in all.
    ///
    /// Under `priority`, small transfers ([`Transfer::is_small`]) do not
    /// count against `max_active`: besides the per-class limit, up to
    /// `max_small_active` of them move at once (all classes together),
    /// admitted in the same order (class, then rank). A burst of tiny
    /// transfers is then bounded by bytes and a few round trips, not one
    /// round trip after another four at a time.
    ///
    /// Under `priority` with `deadline_first`, a transfer with a deadline
    /// starts at once and does not count against any limit, and is listed
    /// first in its class, earliest deadline first: the class's slack
    /// test ([`crate::deadline`]) must see every deadline of the class.
    /// Deadlines are few (evals waiting on a slot); their bytes are still
    /// served within the class's weight.
    pub fn admit(&self, waiting: &[Transfer], now_ms: i64) -> Vec<TransferId> {
        self.admit_in_pool(waiting, &[], now_ms)
    }

    /// Whether an agent of a pool of `peers` live agents, running
    /// `running` transfers of the link that count against `max_active`,
    /// should leave the admitted transfer `t`, queued `queued_ms`
    /// milliseconds ago, to the other agents for now: it already runs its
    /// share, `ceil(max_active / peers)`, `t` counts against `max_active`
    /// (it is not small), and `t` has waited less than `wait_ms` (after
    /// that any agent with room takes it, so a transfer no other agent can
    /// run is not left waiting). One agent alone never leaves anything.
    pub fn leave_to_peers(
        &self,
        t: &Transfer,
        running: usize,
        peers: u32,
        queued_ms: i64,
        wait_ms: i64,
    ) -> bool {
        if peers <= 1 || t.is_small(&self.policy) || queued_ms >= wait_ms {
            return false;
        }
        let share = self.policy.max_active.max(1).div_ceil(peers as usize);
        running >= share
    }

    /// As [`LinkScheduler::admit`], in a pool of agents: `elsewhere` are
    /// the link's transfers other agents of the pool run now, which count
    /// against `max_active` (and `max_small_active`) like this agent's
    /// own active ones: the limits hold for the whole pool.
    pub fn admit_in_pool(
        &self,
        waiting: &[Transfer],
        elsewhere: &[Transfer],
        now_ms: i64,
    ) -> Vec<TransferId> {
        let max = self.policy.max_active.max(1);
        if self.policy.kind == PolicyKind::Fifo {
            let free = max.saturating_sub(self.entries.len() + elsewhere.len());
            let mut w: Vec<&Transfer> = waiting
                .iter()
                .filter(|t| !self.entries.contains_key(&t.id))
                .collect();
            w.sort_by_key(|t| (t.created_ms, t.id));
            return w.into_iter().take(free).map(|t| t.id).collect();
        }
        // With a cap of 1 aging is off, and so is the overdue rule.
        let overdue_ms = if self.policy.aging_cap > 1.0 {
            (self.policy.aging_ms as f64 * (self.policy.aging_cap - 1.0)) as i64
        } else {
            i64::MAX
        };
        let mut out = Vec::new();
        let small = |t: &Transfer| t.is_small(&self.policy);
        let mut small_free = self.policy.max_small_active.saturating_sub(
            self.entries.values().filter(|e| small(&e.t)).count()
                + elsewhere.iter().filter(|t| small(t)).count(),
        );
        for class in CLASSES {
            let counts = |t: &Transfer| {
                t.class == class
                    && !small(t)
                    && !(self.policy.deadline_first && t.deadline_ms.is_some())
            };
            let active = self.entries.values().filter(|e| counts(&e.t)).count()
                + elsewhere.iter().filter(|t| counts(t)).count();
            let mut free = max.saturating_sub(active);
            let mut w: Vec<(bool, f64, &Transfer)> = waiting
                .iter()
                .filter(|t| t.class == class && !self.entries.contains_key(&t.id))
                .map(|t| {
                    let overdue = now_ms.saturating_sub(t.created_ms) >= overdue_ms;
                    (overdue, self.score_of(t, now_ms).value, t)
                })
                .collect();
            // With deadline_first, transfers with a deadline go first,
            // earliest deadline first.
            let edf = |t: &Transfer| {
                if self.policy.deadline_first {
                    t.deadline_ms.unwrap_or(i64::MAX)
                } else {
                    i64::MAX
                }
            };
            w.sort_by(|a, b| {
                edf(a.2)
                    .cmp(&edf(b.2))
                    .then(b.0.cmp(&a.0))
                    .then_with(|| {
                        if a.0 {
                            std::cmp::Ordering::Equal
                        } else {
                            b.1.total_cmp(&a.1)
                        }
                    })
                    .then((a.2.created_ms, a.2.id).cmp(&(b.2.created_ms, b.2.id)))
            });
            for (_, _, t) in w {
                if self.policy.deadline_first && t.deadline_ms.is_some() {
                    // Deadlines start at once: the class's slack test
                    // must see all of them.
                } else if small(t) && small_free > 0 {
                    small_free -= 1;
                } else if free > 0 {
                    free -= 1;
                } else {
                    continue;
                }
                out.push(t.id);
            }
        }
        out
    }
}
