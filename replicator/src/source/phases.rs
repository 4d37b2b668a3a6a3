//! The source's phase clock: what each transfer was doing, on this
//! agent's monotonic clock, from its creation to its publish (see
//! [`ferry_proto::phases`]).
//!
//! Each transfer keeps a log of events (created, first files seen, run
//! started and ended, commit seen, commit sent, chunks asked for again,
//! published); the phases are computed from the log whenever they are
//! asked for, so events recorded out of order (the watcher sees a commit
//! while the transfer waits for its run) still add up. Every instant
//! between the first event and the last belongs to exactly one phase,
//! and the phases after the commit start where the watcher saw it, with
//! the time from the commit marker's mtime to that moment as
//! [`Phase::Writer`]: on one host their sum is the commit-to-now time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferry_proto::phases::{Phase, Phases};
use ferry_proto::state::TransferId;

/// Something that changes what a transfer is doing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Event {
    /// Queued in the catalog (announced or not).
    Created,
    /// The checkpoint's first files appeared (after an announcement).
    Opened,
    /// The scheduler started a run.
    RunStart,
    /// The run ended without a publish (pre-empted, paused, lost
    /// connection).
    RunEnd,
    /// The watcher saw the commit; the writer's share is the time from
    /// the commit marker's mtime to here.
    CommitSeen { writer: Duration },
    /// The commit message went to the sink.
    CommitSent,
    /// The sink asked for chunks again.
    Need,
}

/// One transfer's log.
#[derive(Debug, Default, Clone)]
pub(crate) struct PhaseLog {
    events: Vec<(Instant, Event)>,
    /// Whether the transfer was announced before its first files.
    announced: bool,
    /// A pushed directory: committed when queued, with no writer to wait
    /// for (no `waiting_for_writer` phase).
    pushed: bool,
}

impl PhaseLog {
    /// Adds `e` at `at`. A second commit seen is ignored (the first
    /// counts).
    pub(crate) fn note(&mut self, at: Instant, e: Event) {
        if matches!(e, Event::CommitSeen { .. })
            && self
                .events
                .iter()
                .any(|(_, x)| matches!(x, Event::CommitSeen { .. }))
        {
            return;
        }
        if e == Event::Created && self.events.iter().any(|(_, x)| *x == Event::Created) {
            return;
        }
        self.events.push((at, e));
    }

    /// True once a creation was recorded.
    pub(crate) fn has_created(&self) -> bool {
        self.events.iter().any(|(_, e)| *e == Event::Created)
    }

    /// The phases until the last commit message went (what the sink was
    /// told; after it the time is the sink's), or until `now` if none
    /// went.
    pub(crate) fn phases_to_commit(&self, now: Instant) -> Phases {
        let last = self
            .events
            .iter()
            .filter(|(_, e)| *e == Event::CommitSent)
            .map(|(at, _)| *at)
            .max();
        self.phases(last.unwrap_or(now))
    }

    /// The phases from the first event until `now` (events after it are
    /// left out).
    pub(crate) fn phases(&self, now: Instant) -> Phases {
        let mut ev: Vec<_> = self
            .events
            .iter()
            .copied()
            .filter(|(at, _)| *at <= now)
            .collect();
        ev.sort_by_key(|(at, _)| *at);
        let mut out = Phases::default();
        let Some(&(first, _)) = ev.first() else {
            return out;
        };
        let announced = self.announced && ev.iter().any(|(_, e)| *e == Event::Opened);
        let (mut opened, mut running, mut verifying, mut committed) =
            (!announced, false, false, false);
        let mut since = first;
        let current = |opened: bool, running: bool, verifying: bool, committed: bool| {
            if !opened {
                Phase::Announced
            } else if !running {
                Phase::Queued
            } else if verifying {
                Phase::Verifying
            } else if committed {
                Phase::Sending
            } else {
                Phase::Streaming
            }
        };
        for (at, e) in ev
            .iter()
            .copied()
            .chain(std::iter::once((now, Event::Created)))
        {
            let at = at.max(since);
            out.add(
                committed,
                current(opened, running, verifying, committed),
                at - since,
            );
            since = at;
            match e {
                Event::Created => {}
                Event::Opened => opened = true,
                Event::RunStart => {
                    running = true;
                    verifying = false;
                    opened = true;
                }
                Event::RunEnd => {
                    running = false;
                    verifying = false;
                }
                Event::CommitSeen { writer } => {
                    if !committed {
                        committed = true;
                        if !self.pushed {
                            out.add(true, Phase::Writer, writer);
                        }
                    }
                }
                Event::CommitSent => verifying = true,
                Event::Need => verifying = false,
            }
        }
        out.before.retain(|_, d| !d.is_zero());
        out.after.retain(|p, d| !d.is_zero() || *p == Phase::Writer);
        out
    }
}

/// Every live transfer's log.
#[derive(Debug, Default)]
pub(crate) struct PhaseClocks(std::sync::Mutex<HashMap<TransferId, PhaseLog>>);

/// The instant `ms` (Unix ms on this host's wall clock, read as
/// `now_ms` at `now`) was, on the monotonic clock: `now` minus the
/// wall-clock time since; `now` for a time in the future or before the
/// monotonic clock's start.
pub(crate) fn instant_at(ms: i64, now: Instant, now_ms: i64) -> Instant {
    let ago = Duration::from_millis(u64::try_from(now_ms.saturating_sub(ms)).unwrap_or(0));
    now.checked_sub(ago).unwrap_or(now)
}

impl PhaseClocks {
    /// Records `e` for `id` now.
    pub(crate) fn note(&self, id: TransferId, e: Event) {
        self.note_at(id, Instant::now(), e);
    }

    /// Records `e` for `id` at `at`.
    pub(crate) fn note_at(&self, id: TransferId, at: Instant, e: Event) {
        crate::lock::lock(&self.0)
            .entry(id)
            .or_default()
            .note(at, e);
    }

    /// Records what the catalog knows of a transfer about to run, once:
    /// its creation (`created_ms`), its first files (`opened_ms`, after
    /// an announcement) and, for a pushed directory (`pushed`), its
    /// commit at creation. Unix ms on this host's clock.
    pub(crate) fn begin(
        &self,
        id: TransferId,
        created_ms: i64,
        opened_ms: Option<i64>,
        pushed: bool,
    ) {
        let (now, now_ms) = (Instant::now(), ferry_catalog::now_ms());
        let mut m = crate::lock::lock(&self.0);
        let log = m.entry(id).or_default();
        if log.has_created() {
            return;
        }
        let created = instant_at(created_ms, now, now_ms);
        log.note(created, Event::Created);
        if let Some(o) = opened_ms.filter(|o| *o > created_ms) {
            log.announced = true;
            log.note(instant_at(o, now, now_ms), Event::Opened);
        }
        if pushed {
            log.pushed = true;
            log.note(
                created,
                Event::CommitSeen {
                    writer: Duration::ZERO,
                },
            );
        }
    }

    /// The phases of `id` so far, if it has a log.
    pub(crate) fn phases(&self, id: TransferId) -> Option<Phases> {
        crate::lock::lock(&self.0)
            .get(&id)
            .map(|l| l.phases(Instant::now()))
    }

    /// Ends `id`'s log: its phases until its last commit message went
    /// ([`PhaseLog::phases_to_commit`]).
    pub(crate) fn finish(&self, id: TransferId) -> Option<Phases> {
        crate::lock::lock(&self.0)
            .remove(&id)
            .map(|l| l.phases_to_commit(Instant::now()))
    }

    /// Drops `id`'s log (cancelled, failed).
    pub(crate) fn forget(&self, id: TransferId) {
        crate::lock::lock(&self.0).remove(&id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn an_announced_streamed_checkpoint_passes_every_phase_and_they_add_up() {
        let t0 = Instant::now();
        let mut l = PhaseLog {
            announced: true,
            ..PhaseLog::default()
        };
        // Recorded out of order: the watcher saw the commit before the
        // run's log was begun.
        l.note(t0 + ms(5_000), Event::CommitSeen { writer: ms(300) });
        l.note(t0, Event::Created);
        l.note(t0 + ms(1_000), Event::Opened);
        l.note(t0 + ms(1_500), Event::RunStart);
        l.note(t0 + ms(3_000), Event::RunEnd);
        l.note(t0 + ms(6_000), Event::RunStart);
        l.note(t0 + ms(8_000), Event::CommitSent);
        l.note(t0 + ms(8_100), Event::Need);
        l.note(t0 + ms(8_400), Event::CommitSent);
        let p = l.phases(t0 + ms(8_400));
        assert_eq!(p.before[&Phase::Announced], ms(1_000));
        assert_eq!(p.before[&Phase::Queued], ms(500 + 2_000));
        assert_eq!(p.before[&Phase::Streaming], ms(1_500));
        assert_eq!(p.after[&Phase::Writer], ms(300));
        assert_eq!(p.after[&Phase::Queued], ms(1_000));
        assert_eq!(p.after[&Phase::Sending], ms(2_000 + 300));
        assert_eq!(p.after[&Phase::Verifying], ms(100));
        // After the commit: the writer's share plus commit seen to now.
        assert_eq!(p.after_total(), ms(300 + 3_400));
        assert_eq!(p.dominant(), Some((Phase::Sending, ms(2_300))));
        // What the sink was told: up to the last commit, however late
        // asked; an earlier instant leaves later events out.
        assert_eq!(l.phases_to_commit(t0 + ms(9_999)), p);
        let early = l.phases(t0 + ms(2_000));
        assert_eq!(early.before[&Phase::Streaming], ms(500));
        assert!(early.after.is_empty(), "{early:?}");
    }

    #[test]
    fn a_push_is_committed_at_creation_and_a_second_commit_counts_once() {
        let t0 = Instant::now();
        let mut l = PhaseLog {
            pushed: true,
            ..PhaseLog::default()
        };
        l.note(t0, Event::Created);
        l.note(t0, Event::CommitSeen { writer: ms(0) });
        l.note(t0 + ms(700), Event::RunStart);
        l.note(t0 + ms(900), Event::CommitSeen { writer: ms(50) });
        l.note(t0 + ms(2_700), Event::CommitSent);
        let p = l.phases(t0 + ms(3_000));
        assert!(p.before.is_empty(), "{p:?}");
        assert!(
            !p.after.contains_key(&Phase::Writer),
            "no writer to wait for: {p:?}"
        );
        assert_eq!(p.after[&Phase::Queued], ms(700));
        assert_eq!(p.after[&Phase::Sending], ms(2_000));
        assert_eq!(p.after[&Phase::Verifying], ms(300));
        assert_eq!(p.after_total(), ms(3_000));
        // Not announced: no announced phase even with an open time.
        assert!(!p.before.contains_key(&Phase::Announced));
    }

    #[test]
    fn instants_from_wall_clock_times_are_in_the_past_and_never_panic() {
        let now = Instant::now();
        assert_eq!(instant_at(10_000, now, 10_000), now);
        assert_eq!(instant_at(9_000, now, 10_000), now - ms(1_000));
        assert_eq!(instant_at(11_000, now, 10_000), now, "a future time is now");
        let _ = instant_at(i64::MIN, now, i64::MAX);
    }
}
