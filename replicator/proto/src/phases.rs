//! Where the time to eval-ready goes: the phases of a checkpoint's way
//! from the training job's commit to its replica's publish, and their
//! encoding on the wire (protocol version 7, [`crate::wire::PHASES_VERSION`]).
//!
//! Each phase is a duration measured on one agent's monotonic clock: the
//! source measures what happens before its commit message goes (the
//! writer's last files, the queue, sending), the sink what happens after
//! it arrives (the batches still in flight, verification and read-back,
//! the publish). Only the durations cross the network, never a clock
//! reading, so the phases need no synchronised clocks; the commit time
//! itself is a wall-clock time (the commit marker's mtime), and the
//! difference between the wall-clock commit-to-publish time and the
//! phases' sum is the one-way delay of the commit message plus the skew
//! between the two hosts' clocks, reported on its own.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::codec::{Reader, WireError, Writer};

/// One phase of a replica's way to eval-ready. Before the commit:
/// [`Phase::Announced`], [`Phase::Queued`], [`Phase::Streaming`]; after
/// it: [`Phase::Writer`], [`Phase::Queued`], [`Phase::Sending`],
/// [`Phase::Verifying`], [`Phase::Publishing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Announced by the training job (`POST /v1/checkpoints/announce`),
    /// its first file not written yet.
    Announced,
    /// Waiting for the scheduler to start it (the link's `max_active`, a
    /// higher class, or, in a pool, another agent).
    Queued,
    /// Before the commit: sending the files the writer has written so
    /// far, ahead of the writer.
    Streaming,
    /// After the commit: from the commit marker's time until the watcher
    /// saw the checkpoint complete (the writer's last files, the quiet
    /// period, the scan interval of a polled root). Absent for a push.
    Writer,
    /// After the commit: sending, until the commit message went, and at
    /// the sink until the last batch arrived; includes chunks sent again
    /// on request.
    Sending,
    /// At the sink: checking the sealed manifest and reading staging back
    /// against every chunk's BLAKE3 hash (`reread_before_publish`); at
    /// the source: waiting for the sink's answer to a commit.
    Verifying,
    /// At the sink: moving the replica into place, syncing it and
    /// recording it in the catalog.
    Publishing,
}

impl Phase {
    /// Every phase, in the order a checkpoint passes them.
    pub const ALL: [Phase; 7] = [
        Phase::Announced,
        Phase::Queued,
        Phase::Streaming,
        Phase::Writer,
        Phase::Sending,
        Phase::Verifying,
        Phase::Publishing,
    ];

    /// The name used in the API, the metrics' `phase` label and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Announced => "announced",
            Phase::Queued => "queued",
            Phase::Streaming => "streaming",
            Phase::Writer => "waiting_for_writer",
            Phase::Sending => "sending",
            Phase::Verifying => "verifying",
            Phase::Publishing => "publishing",
        }
    }

    /// The phase named `s` ([`Phase::as_str`]).
    pub fn parse(s: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.as_str() == s)
    }

    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(c: u8) -> Option<Phase> {
        Phase::ALL.get(usize::from(c)).copied()
    }
}

impl std::fmt::Display for Phase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Time spent in each phase, before and after the commit. A phase that
/// was not passed is absent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Phases {
    /// Before the commit (announced, queued, streaming).
    pub before: BTreeMap<Phase, Duration>,
    /// After the commit (the writer, queued, sending, verifying,
    /// publishing): on one host their sum is the commit-to-eval-ready
    /// time.
    pub after: BTreeMap<Phase, Duration>,
}

/// Most phases one side of [`Phases`] may list on the wire.
const MAX_PHASES: usize = Phase::ALL.len();

impl Phases {
    /// True when no phase was recorded.
    pub fn is_empty(&self) -> bool {
        self.before.is_empty() && self.after.is_empty()
    }

    /// Adds `d` to `phase` before or after the commit.
    pub fn add(&mut self, after_commit: bool, phase: Phase, d: Duration) {
        let side = if after_commit {
            &mut self.after
        } else {
            &mut self.before
        };
        *side.entry(phase).or_default() += d;
    }

    /// Adds every phase of `other` (the sink adds its own to the
    /// source's).
    pub fn merge(&mut self, other: &Phases) {
        for (p, d) in &other.before {
            self.add(false, *p, *d);
        }
        for (p, d) in &other.after {
            self.add(true, *p, *d);
        }
    }

    /// Sum of the phases after the commit.
    pub fn after_total(&self) -> Duration {
        self.after.values().sum()
    }

    /// The longest phase after the commit, if any.
    pub fn dominant(&self) -> Option<(Phase, Duration)> {
        self.after
            .iter()
            .max_by_key(|(_, d)| **d)
            .map(|(p, d)| (*p, *d))
    }

    /// Encodes both sides: for each, a `u8` count, then per phase its
    /// `u8` code and its duration in microseconds (`u64`).
    pub(crate) fn encode(&self, w: &mut Writer) {
        for side in [&self.before, &self.after] {
            w.u8(side.len() as u8);
            for (p, d) in side {
                w.u8(p.code());
                w.u64(u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
            }
        }
    }

    /// Decodes what [`Phases::encode`] wrote: phases in code order on
    /// each side, at least one in all (the encoding is canonical).
    ///
    /// # Errors
    /// [`WireError`] for more phases than exist, an unknown phase code, a
    /// phase listed twice or out of order, or none at all.
    pub(crate) fn decode(r: &mut Reader<'_>) -> Result<Phases, WireError> {
        let mut out = Phases::default();
        for after in [false, true] {
            let n = usize::from(r.u8("phase count")?);
            if n > MAX_PHASES {
                return Err(WireError::TooLarge {
                    what: "phase count",
                    got: n as u64,
                    limit: MAX_PHASES as u64,
                });
            }
            let mut last: Option<Phase> = None;
            for _ in 0..n {
                let code = r.u8("phase")?;
                let p = Phase::from_code(code).ok_or_else(|| WireError::Invalid {
                    what: "phase",
                    why: format!("unknown phase code {code}"),
                })?;
                if last.is_some_and(|l| l >= p) {
                    return Err(WireError::Invalid {
                        what: "phase",
                        why: format!("{p} listed twice or out of order"),
                    });
                }
                last = Some(p);
                let d = Duration::from_micros(r.u64("phase duration")?);
                let side = if after {
                    &mut out.after
                } else {
                    &mut out.before
                };
                side.insert(p, d);
            }
        }
        if out.is_empty() {
            return Err(WireError::Invalid {
                what: "phases",
                why: "present but none listed".into(),
            });
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_codes_are_the_order() {
        for (i, p) in Phase::ALL.into_iter().enumerate() {
            assert_eq!(Phase::parse(p.as_str()), Some(p));
            assert_eq!(Phase::from_code(i as u8), Some(p));
        }
        assert_eq!(Phase::parse("waiting"), None);
        assert_eq!(Phase::from_code(7), None);
    }

    #[test]
    fn merge_adds_and_the_dominant_phase_is_the_longest_after_commit() {
        let mut a = Phases::default();
        a.add(false, Phase::Streaming, Duration::from_secs(30));
        a.add(true, Phase::Sending, Duration::from_millis(1500));
        let mut b = Phases::default();
        b.add(true, Phase::Sending, Duration::from_millis(500));
        b.add(true, Phase::Publishing, Duration::from_millis(100));
        a.merge(&b);
        assert_eq!(a.after[&Phase::Sending], Duration::from_secs(2));
        assert_eq!(a.after_total(), Duration::from_millis(2100));
        assert_eq!(a.dominant(), Some((Phase::Sending, Duration::from_secs(2))));
        assert_eq!(a.before[&Phase::Streaming], Duration::from_secs(30));
    }
}
