//! A congestion controller that knows the link's configured share.
//!
//! Ferry is told its share of the WAN (the link's rate cap, bit/s), so
//! instead of probing like Cubic it keeps a window of about
//! [`WINDOW_GAIN`]` x share x base RTT` in flight, paced by quinn's pacer, and backs
//! off only on *sustained* loss or queueing delay, which means something
//! outside Ferry is using the link too. Random loss of a few percent does
//! not shrink the window (Cubic collapses there on a 100 ms path).
//!
//! When the share falls because a pool's other agent claimed part of
//! this one's transfer ([`Share::ease_rate_bps`]), the window follows
//! over one base RTT of acks rather than at once: cut at once, a
//! connection with a full old window in flight sends nothing until the
//! acks bring it under the new one, about 50 ms when the share halves,
//! and the pool's bytes at the sink dip while the other agent's start.
//! An increase, and a decrease for a pre-emption, apply at once.
//!
//! Measured facts behind this (issue "The spine", Transport facts): on an
//! emulated 100 ms, 1 Gbit/s link with a one-BDP drop-tail queue, Cubic
//! reached 0.87 of the link and this kind of controller 0.935 with zero
//! loss.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use quinn::congestion::{Controller, ControllerFactory};
use quinn_proto::RttEstimator;

/// Multiple of `rate x base RTT` kept in flight. The window has to cover
/// the rate for the time an ack really takes, which is the minimum RTT plus
/// the receiver's ack delay and both agents' processing latency. Measured
/// with `ferry demo` (1 Gbit/s, 100 ms, 1.4 GB, both agents in one process
/// on 2 cores): gain 0.98 gave 0.87-0.88 of the link, 1.05 gave 0.91-0.93,
/// 1.10 gave 0.93, all with no queue drops. The excess over 1 (with
/// [`PROCESSING_ALLOWANCE`]) is at most a standing queue of 8 % of the RTT
/// plus 3 ms at the bottleneck, under the delay that makes the controller
/// back off.
pub const WINDOW_GAIN: f64 = 1.08;

/// Time added to the RTT when sizing the window, for the agents'
/// processing latency (endpoint drivers, hashing and disk writes on busy
/// cores), which matters most on short paths.
pub const PROCESSING_ALLOWANCE: Duration = Duration::from_millis(3);

/// Loss fraction over one RTT epoch above which an epoch counts as lossy.
pub const LOSS_THRESHOLD: f64 = 0.05;

/// Consecutive lossy epochs before backing off (so a burst is not
/// "sustained").
pub const LOSSY_EPOCHS: u32 = 2;

/// Queueing delay (smoothed RTT above the minimum) that counts as a
/// standing queue: `max(base RTT / 4, 5 ms)`.
fn queue_threshold(base: Duration) -> Duration {
    (base / 4).max(Duration::from_millis(5))
}

/// Smallest fraction of the share the controller backs off to on loss.
pub const MIN_FACTOR_LOSS: f64 = 0.25;

/// Smallest fraction of the share the controller backs off to on delay
/// alone (a loss-based competitor fills the queue; giving way entirely to
/// it would starve Ferry).
pub const MIN_FACTOR_DELAY: f64 = 0.5;

/// The link's share, shared between the controller factory and whoever may
/// change the rate cap at run time.
#[derive(Debug, Clone)]
pub struct Share {
    rate_bps: Arc<AtomicU64>,
    /// The last decrease: the rate before it (bit/s) and when it came.
    /// Cleared by an increase.
    decreased: Arc<std::sync::Mutex<Option<(u64, Instant)>>>,
}

impl Share {
    /// A share of `rate_bps` bit/s.
    pub fn new(rate_bps: u64) -> Self {
        Share {
            rate_bps: Arc::new(AtomicU64::new(rate_bps.max(1))),
            decreased: Arc::default(),
        }
    }
    /// Current rate cap in bit/s.
    pub fn rate_bps(&self) -> u64 {
        self.rate_bps.load(Ordering::Relaxed)
    }
    /// Changes the rate cap (bit/s); connections follow at once (their
    /// windows are read from it).
    pub fn set_rate_bps(&self, rate: u64) {
        self.rate_bps.store(rate.max(1), Ordering::Relaxed);
        *crate::lock::lock(&self.decreased) = None;
    }

    /// Changes the rate cap (bit/s) like [`Share::set_rate_bps`], but a
    /// decrease reaches the connections' windows over one base RTT of
    /// their acks ([`ShareController`]), so that a connection with a full
    /// old window in flight does not fall silent until the acks bring it
    /// under the new one; Ferry's scheduler, paced at the new rate with
    /// it, holds new chunks to the new rate meanwhile. For a share split
    /// again among a striped transfer's holders, not for a pre-emption.
    pub fn ease_rate_bps(&self, rate: u64) {
        let rate = rate.max(1);
        let old = self.rate_bps.swap(rate, Ordering::Relaxed);
        if rate != old {
            let mut d = crate::lock::lock(&self.decreased);
            *d = (rate < old).then(|| (old, Instant::now()));
        }
    }
    /// The last decrease, if the rate has not risen since: the rate
    /// before it, bit/s, and when it came.
    fn decrease(&self) -> Option<(u64, Instant)> {
        *crate::lock::lock(&self.decreased)
    }
}

/// Builds [`ShareController`]s for quinn.
#[derive(Debug, Clone)]
pub struct ShareControllerFactory {
    /// The link's share.
    pub share: Share,
    /// Expected base RTT before the first measurement.
    pub rtt_hint: Duration,
    /// Connections the link's share is split across (at least 1): each
    /// controller aims at `share / connections`, so the link's connections
    /// together keep the share.
    pub connections: u32,
}

impl ControllerFactory for ShareControllerFactory {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(ShareController {
            share: self.share.clone(),
            connections: self.connections.max(1),
            base_rtt: self.rtt_hint,
            mtu: current_mtu,
            factor: 1.0,
            epoch_start: now,
            epoch_acked: 0,
            epoch_lost: 0,
            lossy_epochs: 0,
            queued_epochs: 0,
            smoothed: self.rtt_hint,
            delay_backoff: false,
            seen: now,
        })
    }
}

/// The controller; see the module documentation.
#[derive(Debug, Clone)]
pub struct ShareController {
    share: Share,
    /// The share is split across this many connections.
    connections: u32,
    base_rtt: Duration,
    mtu: u16,
    /// Fraction of the share currently used, `MIN_FACTOR_LOSS..=1`.
    factor: f64,
    epoch_start: Instant,
    epoch_acked: u64,
    epoch_lost: u64,
    lossy_epochs: u32,
    queued_epochs: u32,
    smoothed: Duration,
    /// Whether the factor is below 1 because of a standing queue (someone
    /// else fills the bottleneck); cleared when the factor is back to 1.
    delay_backoff: bool,
    /// The time of the latest ack or loss, the clock a decrease of the
    /// share is followed by.
    seen: Instant,
}

impl ShareController {
    /// This connection's part of the share, bit/s.
    fn rate_bps(&self) -> f64 {
        self.share.rate_bps() as f64 / f64::from(self.connections)
    }

    /// `share x (base RTT x gain + allowance)` in bytes, where a share
    /// that decreased less than one base RTT ago (by the latest ack) is
    /// still between the old and the new, linearly.
    fn full_window(&self) -> f64 {
        let rtt = self.base_rtt.as_secs_f64() * WINDOW_GAIN + PROCESSING_ALLOWANCE.as_secs_f64();
        let now = self.rate_bps();
        let rate = match self.share.decrease() {
            Some((old, at)) => {
                let old = old as f64 / f64::from(self.connections);
                let done = self.seen.saturating_duration_since(at).as_secs_f64()
                    / self.base_rtt.as_secs_f64().max(1e-6);
                if done < 1.0 && old > now {
                    old - (old - now) * done
                } else {
                    now
                }
            }
            None => now,
        };
        rate / 8.0 * rtt
    }

    fn min_window(&self) -> u64 {
        4 * u64::from(self.mtu)
    }

    /// Closes an epoch of one base RTT: decides whether loss or delay was
    /// sustained, and moves `factor` accordingly.
    fn end_epoch(&mut self, now: Instant) {
        let total = self.epoch_acked + self.epoch_lost;
        let loss = if total == 0 {
            0.0
        } else {
            self.epoch_lost as f64 / total as f64
        };
        if loss > LOSS_THRESHOLD {
            self.lossy_epochs += 1;
        } else {
            self.lossy_epochs = 0;
        }
        if self.smoothed > self.base_rtt + queue_threshold(self.base_rtt) {
            self.queued_epochs += 1;
        } else {
            self.queued_epochs = 0;
        }
        if self.lossy_epochs >= LOSSY_EPOCHS {
            // Loss while a standing queue is someone else's is that flow's
            // tail drop: back off no further than for the queue itself.
            let floor = if self.delay_backoff {
                MIN_FACTOR_DELAY.min(self.factor)
            } else {
                MIN_FACTOR_LOSS
            };
            self.factor = (self.factor * 0.7).max(floor);
        } else if self.queued_epochs >= 2 {
            self.factor = (self.factor * 0.9).max(MIN_FACTOR_DELAY.min(self.factor));
            self.delay_backoff = true;
        } else if total > 0 {
            // Additive recovery towards the full share.
            self.factor = (self.factor + 0.05).min(1.0);
        }
        if self.factor >= 1.0 {
            self.delay_backoff = false;
        }
        self.epoch_start = now;
        self.epoch_acked = 0;
        self.epoch_lost = 0;
    }

    fn record_ack(&mut self, now: Instant, bytes: u64, min_rtt: Duration, smoothed: Duration) {
        self.seen = self.seen.max(now);
        self.epoch_acked += bytes;
        if !min_rtt.is_zero() {
            self.base_rtt = min_rtt;
        }
        self.smoothed = smoothed;
        self.maybe_end_epoch(now);
    }

    fn maybe_end_epoch(&mut self, now: Instant) {
        if now.saturating_duration_since(self.epoch_start) >= self.base_rtt {
            self.end_epoch(now);
        }
    }
}

impl Controller for ShareController {
    fn on_ack(&mut self, now: Instant, _sent: Instant, bytes: u64, _app: bool, rtt: &RttEstimator) {
        self.record_ack(now, bytes, rtt.min(), rtt.get());
    }

    fn on_congestion_event(
        &mut self,
        now: Instant,
        _sent: Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.seen = self.seen.max(now);
        self.epoch_lost += lost_bytes;
        if is_persistent_congestion {
            self.factor = MIN_FACTOR_LOSS;
        }
        self.maybe_end_epoch(now);
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.mtu = new_mtu;
    }

    fn window(&self) -> u64 {
        let mut w = self.full_window();
        if self.delay_backoff && self.factor <= MIN_FACTOR_DELAY + 1e-9 {
            // Backed off to the delay floor and the queue is still there:
            // it is someone else's (a loss-based flow keeps it full). Hold
            // `factor x share` over the RTT actually seen, or the queueing
            // delay would cut Ferry's rate further (ops/bench coexist: 0.20
            // of the link beside one Cubic flow without this). Only at the
            // floor: above it, a delay that is Ferry's own (busy cores
            // answering late) would grow the window, the queue with it, and
            // urgent data would wait behind it (seen in `ferry demo
            // --priority` when this applied at every factor). At half the
            // share, a delay of its own would have to exceed the base RTT
            // to keep a queue standing.
            w = w.max(self.rate_bps() / 8.0 * self.smoothed.as_secs_f64());
        }
        ((w * self.factor) as u64).max(self.min_window())
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(self.clone())
    }

    fn initial_window(&self) -> u64 {
        self.full_window() as u64
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn controller(rate: u64, rtt_ms: u64) -> (Share, ShareController, Instant) {
        controller_of(rate, rtt_ms, 1)
    }

    fn controller_of(
        rate: u64,
        rtt_ms: u64,
        connections: u32,
    ) -> (Share, ShareController, Instant) {
        let share = Share::new(rate);
        let now = Instant::now();
        let f = ShareControllerFactory {
            share: share.clone(),
            rtt_hint: Duration::from_millis(rtt_ms),
            connections,
        };
        let c = *Arc::new(f)
            .build(now, 1452)
            .into_any()
            .downcast::<ShareController>()
            .expect("a ShareController");
        (share, c, now)
    }

    /// Runs `epochs` RTT epochs of 100 ms with `loss` fraction of 1 MB lost
    /// and the given smoothed RTT.
    fn run(c: &mut ShareController, t: &mut Instant, epochs: u32, loss: f64, srtt_ms: u64) {
        for _ in 0..epochs {
            *t += Duration::from_millis(101);
            let lost = (1_000_000.0 * loss) as u64;
            c.on_congestion_event(*t, *t, false, lost);
            let srtt = Duration::from_millis(srtt_ms);
            c.record_ack(*t, 1_000_000 - lost, Duration::from_millis(100), srtt);
        }
    }

    #[test]
    fn window_is_share_times_rtt() {
        let (share, c, _) = controller(1_000_000_000, 100);
        // 1 Gbit/s x (100 ms x gain + allowance).
        let expect = |rate: f64| {
            (rate / 8.0 * (0.1 * WINDOW_GAIN + PROCESSING_ALLOWANCE.as_secs_f64())) as u64
        };
        assert_eq!(c.window(), expect(1e9));
        assert_eq!(c.initial_window(), expect(1e9));
        share.set_rate_bps(500_000_000);
        assert_eq!(c.window(), expect(5e8));
    }

    /// An eased decrease of the share is followed over one base RTT of
    /// acks: the old window until an ack comes, half-way after half an
    /// RTT, the new one from one RTT on; an increase meanwhile applies at
    /// once, and so does a decrease set outright.
    #[test]
    fn an_eased_smaller_share_is_followed_over_one_rtt() {
        let (share, mut c, _) = controller(1_000_000_000, 100);
        let old = c.window();
        share.ease_rate_bps(500_000_000);
        let at = Instant::now();
        assert_eq!(c.window(), old, "no ack yet: the old window");
        let ack = |c: &mut ShareController, ms: u64| {
            c.record_ack(
                at + Duration::from_millis(ms),
                1500,
                Duration::from_millis(100),
                Duration::from_millis(100),
            )
        };
        ack(&mut c, 50);
        let half = c.window();
        assert!(
            half.abs_diff(old * 3 / 4) <= old / 50,
            "{half} half-way, want about {}",
            old * 3 / 4
        );
        ack(&mut c, 100);
        assert!(
            c.window().abs_diff(old / 2) <= 2,
            "{} vs {}",
            c.window(),
            old / 2
        );
        ack(&mut c, 500);
        assert!(c.window().abs_diff(old / 2) <= 2);
        share.ease_rate_bps(1_000_000_000);
        assert_eq!(c.window(), old, "an increase applies at once");
        share.set_rate_bps(500_000_000);
        assert!(c.window().abs_diff(old / 2) <= 2, "set outright: at once");
    }

    #[test]
    fn connections_split_the_share() {
        let (_, one, _) = controller_of(1_000_000_000, 100, 1);
        let share = Share::new(1_000_000_000);
        let f = Arc::new(ShareControllerFactory {
            share: share.clone(),
            rtt_hint: Duration::from_millis(100),
            connections: 4,
        });
        let parts: Vec<_> = (0..4)
            .map(|_| f.clone().build(Instant::now(), 1452))
            .collect();
        let sum = |ps: &[Box<dyn Controller>]| ps.iter().map(|c| c.window()).sum::<u64>();
        // Four connections' windows add up to one connection's (rounding
        // aside), at the start and after a rate change.
        assert!(
            sum(&parts).abs_diff(one.window()) <= 4,
            "{} vs {}",
            sum(&parts),
            one.window()
        );
        let initial: u64 = parts.iter().map(|c| c.initial_window()).sum();
        assert!(initial.abs_diff(one.initial_window()) <= 4);
        share.set_rate_bps(500_000_000);
        assert!(sum(&parts).abs_diff(one.window() / 2) <= 4);
        // No connections counts as one.
        let (_, zero, _) = controller_of(1_000_000_000, 100, 0);
        assert_eq!(zero.window(), one.window());
    }

    #[test]
    fn random_loss_does_not_shrink_the_window() {
        let (_, mut c, mut t) = controller(1_000_000_000, 100);
        let full = c.window();
        run(&mut c, &mut t, 50, 0.01, 100);
        assert_eq!(c.window(), full);
    }

    #[test]
    fn sustained_loss_backs_off_to_the_floor_then_recovers() {
        let (_, mut c, mut t) = controller(1_000_000_000, 100);
        let full = c.window();
        run(&mut c, &mut t, 40, 0.2, 100);
        let w = c.window();
        assert!(w < full / 2, "{w} not below half of {full}");
        assert!(w as f64 >= full as f64 * MIN_FACTOR_LOSS * 0.99);
        run(&mut c, &mut t, 40, 0.0, 100);
        assert_eq!(c.window(), full);
    }

    #[test]
    fn loss_beside_a_standing_queue_keeps_half_the_rate() {
        let (_, mut c, mut t) = controller(1_000_000_000, 100);
        // A loss-based flow fills the queue (RTT 200 ms), then its tail
        // drops hit Ferry too (20 % of an epoch, sustained).
        run(&mut c, &mut t, 10, 0.0, 200);
        run(&mut c, &mut t, 20, 0.2, 200);
        let rate = c.window() as f64 * 8.0 / 0.2;
        assert!(rate >= 1e9 * MIN_FACTOR_DELAY * 0.99, "{rate}");
        // Loss without a standing queue still backs off to the loss floor.
        let (_, mut c, mut t) = controller(1_000_000_000, 100);
        run(&mut c, &mut t, 40, 0.2, 100);
        let rate = c.window() as f64 * 8.0 / 0.1;
        assert!(rate < 1e9 * MIN_FACTOR_DELAY, "{rate}");
    }

    #[test]
    fn standing_queue_backs_off_but_keeps_half_the_rate() {
        let (_, mut c, mut t) = controller(1_000_000_000, 100);
        let full = c.window();
        run(&mut c, &mut t, 40, 0.0, 200);
        let w = c.window();
        // Rate = window / RTT: below the share, but at least half of it at
        // the 200 ms RTT the queue causes.
        let rate = w as f64 * 8.0 / 0.2;
        assert!(rate < 1e9, "{rate} not below the share");
        assert!(rate >= 1e9 * MIN_FACTOR_DELAY * 0.99, "{rate}");
        assert!(w > full / 2, "{w}: window not sized on the RTT seen");
        // The queue gone, the window returns to share x base RTT.
        run(&mut c, &mut t, 40, 0.0, 100);
        assert_eq!(c.window(), full);
    }
}
