//! Write pacing and the kill switch shared by all rank threads of one save.
//!
//! The policy is two pure functions of bytes and elapsed time
//! ([`slice_bytes`], [`pace_delay`]); [`Throttle`] applies them with
//! `std::thread::sleep`, never spinning.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Budget of one write slice at the configured rate (10 ms).
pub(super) const SLICE_TIME: Duration = Duration::from_millis(10);

/// Largest write slice (1 MiB), also used without a rate.
pub(super) const MAX_SLICE: u64 = 1 << 20;

/// Smallest write slice (4 KiB), so slow rates do not mean tiny writes.
pub(super) const MIN_SLICE: u64 = 4 << 10;

/// Bytes one write may carry: [`SLICE_TIME`] worth of the aggregate rate
/// `rate_bps` (bit/s), clamped to [`MIN_SLICE`]..=[`MAX_SLICE`];
/// [`MAX_SLICE`] when unpaced.
pub(super) fn slice_bytes(rate_bps: Option<u64>) -> u64 {
    match rate_bps {
        None => MAX_SLICE,
        Some(bps) => {
            let bytes = u128::from(bps) * SLICE_TIME.as_nanos() / 8 / 1_000_000_000;
            (bytes as u64).clamp(MIN_SLICE, MAX_SLICE)
        }
    }
}

/// How long a writer must sleep after `bytes` bytes in total (all ranks)
/// have been admitted `elapsed` after the save started, so that the
/// aggregate stays at `rate_bps` bit/s: the time those bytes are due at
/// that rate, minus the time already spent; zero when behind schedule.
pub(super) fn pace_delay(bytes: u64, rate_bps: u64, elapsed: Duration) -> Duration {
    let due_nanos = u128::from(bytes) * 8 * 1_000_000_000 / u128::from(rate_bps.max(1));
    let due = Duration::from_nanos(u64::try_from(due_nanos).unwrap_or(u64::MAX));
    due.saturating_sub(elapsed)
}

/// Marks the error a write gets once the save is killed
/// ([`crate::format::Fault::KillMidSave`]).
#[derive(Debug)]
pub(super) struct Killed;

impl std::fmt::Display for Killed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("save killed (simulated)")
    }
}

impl std::error::Error for Killed {}

/// Admits writes for every rank of one save: paces them to the aggregate
/// rate and, for a kill fault, refuses every byte past `kill_at`.
#[derive(Debug)]
pub(super) struct Throttle {
    /// Aggregate rate in bit/s; `None` writes as fast as the disk allows.
    rate_bps: Option<u64>,
    /// Bytes admitted so far, all ranks.
    admitted: AtomicU64,
    /// When pacing started.
    start: Instant,
    /// Total bytes after which writes fail with [`Killed`].
    kill_at: Option<u64>,
    /// Once stopped, every write fails ("save stopped").
    stop: super::StopFlag,
}

impl Throttle {
    /// A throttle starting now.
    pub(super) fn new(rate_bps: Option<u64>, kill_at: Option<u64>, stop: super::StopFlag) -> Self {
        Self {
            rate_bps,
            admitted: AtomicU64::new(0),
            start: Instant::now(),
            kill_at,
            stop,
        }
    }

    /// Admits up to `want` bytes (at least 1 when `want > 0`): at most one
    /// slice, fewer at the kill point. Sleeps first when the writers are
    /// ahead of the rate.
    ///
    /// # Errors
    /// An error wrapping [`Killed`] once `kill_at` bytes were admitted;
    /// "save stopped" once the save's [`super::StopFlag`] is set.
    pub(super) fn admit(&self, want: u64) -> io::Result<u64> {
        if self.stop.is_stopped() {
            return Err(io::Error::other("save stopped"));
        }
        let slice = want.min(slice_bytes(self.rate_bps));
        let before = self.admitted.fetch_add(slice, Ordering::Relaxed);
        let mut granted = slice;
        if let Some(limit) = self.kill_at {
            if before >= limit {
                return Err(io::Error::other(Killed));
            }
            granted = granted.min(limit - before);
        }
        if let Some(bps) = self.rate_bps {
            let delay = pace_delay(before + granted, bps, self.start.elapsed());
            if !delay.is_zero() {
                std::thread::sleep(delay);
            }
        }
        Ok(granted)
    }

    /// Whether the kill point was passed.
    pub(super) fn killed(&self) -> bool {
        self.kill_at
            .is_some_and(|limit| self.admitted.load(Ordering::Relaxed) >= limit)
    }
}

/// Whether `e` is the error of a killed save.
pub(super) fn is_killed(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Killed>())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn slice_is_ten_ms_of_the_aggregate_rate() {
        // 500 Mbit/s = 62.5 MB/s: 10 ms are 625 kB.
        assert_eq!(slice_bytes(Some(500_000_000)), 625_000);
        assert_eq!(slice_bytes(Some(8_000_000)), 10_000);
        assert_eq!(slice_bytes(Some(1_000)), MIN_SLICE);
        assert_eq!(slice_bytes(Some(10_000_000_000_000)), MAX_SLICE);
        assert_eq!(slice_bytes(None), MAX_SLICE);
    }

    #[test]
    fn delay_is_due_time_minus_elapsed() {
        let ms = Duration::from_millis;
        // 1 MB at 8 Mbit/s (1 MB/s) is due after 1 s.
        assert_eq!(pace_delay(1_000_000, 8_000_000, ms(0)), ms(1000));
        assert_eq!(pace_delay(1_000_000, 8_000_000, ms(250)), ms(750));
        assert_eq!(pace_delay(1_000_000, 8_000_000, ms(1000)), ms(0));
        assert_eq!(
            pace_delay(1_000_000, 8_000_000, ms(5000)),
            ms(0),
            "behind: no sleep"
        );
        // One slice at the rate is one slice time.
        let bps = 500_000_000;
        assert_eq!(pace_delay(slice_bytes(Some(bps)), bps, ms(0)), SLICE_TIME);
        // Four ranks each one slice in: 40 ms due at 0 elapsed.
        assert_eq!(
            pace_delay(4 * slice_bytes(Some(bps)), bps, ms(0)),
            4 * SLICE_TIME
        );
        assert_eq!(
            pace_delay(u64::MAX, 1, ms(0)),
            Duration::from_nanos(u64::MAX)
        );
    }

    #[test]
    fn kill_point_stops_admission() {
        let t = Throttle::new(None, Some(10_000), Default::default());
        assert_eq!(t.admit(6_000).unwrap(), 6_000);
        assert!(!t.killed());
        assert_eq!(
            t.admit(6_000).unwrap(),
            4_000,
            "granted up to the kill point"
        );
        assert!(t.killed());
        assert!(is_killed(&t.admit(1).unwrap_err()));
        let free = Throttle::new(None, None, Default::default());
        assert_eq!(free.admit(5 << 20).unwrap(), MAX_SLICE);
    }

    #[test]
    fn stop_flag_fails_the_next_write() {
        let stop = super::super::StopFlag::default();
        let t = Throttle::new(Some(8_000_000), None, stop.clone());
        assert!(t.admit(1000).is_ok());
        stop.stop();
        let e = t.admit(1000).unwrap_err();
        assert!(
            e.to_string().contains("save stopped") && !is_killed(&e),
            "{e}"
        );
    }
}
