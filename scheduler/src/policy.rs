//! The scheduler's settings: policy, score weights, aging, signal decay,
//! class floors and how many transfers run at once. Defaults and their
//! effect are documented on each field and in `ops/ferry.example.toml`.

use crate::Class;

/// How transfers are ranked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PolicyKind {
    /// Classes, floors and scores (ARCHITECTURE.md "Classes and score").
    #[default]
    Priority,
    /// First come, first served: classes, scores and signals are recorded
    /// but do not change the order (the baseline the benchmark compares
    /// against).
    Fifo,
}

impl PolicyKind {
    /// The name used in config (`"priority"`, `"fifo"`).
    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::Priority => "priority",
            PolicyKind::Fifo => "fifo",
        }
    }
}

/// Weights of the score's terms: `score = (1 + size x log10(params / 1e9))
/// x (1 + importance x importance) x (1 + severity x severity(t)) x aging`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Weights {
    /// `a`, per decade of model parameters above 1e9. Default 0.5: a 70B
    /// job's term is 1.92, a 7B job's 1.42, a 10x larger model gets about
    /// 1.35x the share of its 10x smaller peer.
    pub size: f64,
    /// `b`, times the job's importance (0..1). Default 1.0: maximal
    /// importance doubles the share.
    pub importance: f64,
    /// `c`, times the job's live signal severity (0..1, decaying). Default
    /// 2.0: a fresh severity-1 signal triples the share.
    pub severity: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            size: 0.5,
            importance: 1.0,
            severity: 2.0,
        }
    }
}

/// Share a lower class keeps while a higher class is busy, each 0..0.5
/// and together at most 0.9 (defaults: scheduled 10 %, background 5 %).
/// A floor of 0 lets that class wait as long as higher classes have data
/// to send.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Floors {
    /// Floor of `scheduled` while `urgent` is busy.
    pub scheduled: f64,
    /// Floor of `background` while `urgent` or `scheduled` is busy.
    pub background: f64,
}

impl Default for Floors {
    fn default() -> Self {
        Floors {
            scheduled: 0.10,
            background: 0.05,
        }
    }
}

impl Floors {
    /// The floor of `class` (0 for `urgent`, which has none).
    pub fn of(&self, class: Class) -> f64 {
        match class {
            Class::Urgent => 0.0,
            Class::Scheduled => self.scheduled,
            Class::Background => self.background,
        }
    }
}

/// Everything the scheduler is configured with. Times are milliseconds.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// Ranking on or off.
    pub kind: PolicyKind,
    /// Score weights.
    pub weights: Weights,
    /// `T` of the aging term `min(1 + waiting / T, cap)`, ms. Default
    /// 600,000 (10 min).
    pub aging_ms: u64,
    /// `cap` of the aging term, >= 1. Default 2.0 (reached after
    /// `T x (cap - 1)` = 10 min of waiting). A transfer that has waited
    /// that long is admitted before any younger one of its class.
    pub aging_cap: f64,
    /// Half-life of a signal's severity, ms. Default 600,000 (10 min).
    pub severity_half_life_ms: u64,
    /// How long a signal keeps its job's newest unpublished checkpoint
    /// `urgent`, ms. Default 1,800,000 (30 min).
    pub urgent_for_ms: u64,
    /// Class floors.
    pub floors: Floors,
    /// Transfers of one class that move at once on one link (the others
    /// wait in the queue, ranked). Default 4. Under `Fifo`, the limit is
    /// for all classes together.
    pub max_active: usize,
    /// A transfer whose size is known and at most this many bytes is
    /// small: it does not count against `max_active`. Default 16 MiB
    /// (16,777,216: one batch at the default `[source] batch_size`).
    pub small_bytes: u64,
    /// Small transfers that move at once on one link (all classes
    /// together), besides the `max_active` per class; 0 turns the small
    /// transfer rule off. Default 256. Only under `Priority`.
    pub max_small_active: usize,
    /// Within a class, serve transfers with a deadline earliest deadline
    /// first ahead of score order while one of their deadlines is at risk,
    /// and admit them first (see [`crate::deadline`]). Default true;
    /// false serves them by score like the others (the baseline).
    pub deadline_first: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            kind: PolicyKind::Priority,
            weights: Weights::default(),
            aging_ms: 600_000,
            aging_cap: 2.0,
            severity_half_life_ms: 600_000,
            urgent_for_ms: 1_800_000,
            floors: Floors::default(),
            max_active: 4,
            small_bytes: 16 << 20,
            max_small_active: 256,
            deadline_first: true,
        }
    }
}

impl Policy {
    /// Checks the settings; the error names the setting (as in config,
    /// `[scheduler]`).
    ///
    /// # Errors
    /// A message naming the first bad setting.
    pub fn check(&self) -> Result<(), String> {
        let w = &self.weights;
        for (name, v) in [
            ("weights.model_size", w.size),
            ("weights.importance", w.importance),
            ("weights.severity", w.severity),
        ] {
            if !v.is_finite() || !(0.0..=100.0).contains(&v) {
                return Err(format!("{name} must be a number from 0 to 100, got {v}"));
            }
        }
        const YEAR_MS: u64 = 365 * 24 * 3600 * 1000;
        for (name, v) in [
            ("aging", self.aging_ms),
            ("severity_half_life", self.severity_half_life_ms),
            ("urgent_for", self.urgent_for_ms),
        ] {
            if v == 0 || v > YEAR_MS {
                return Err(format!(
                    "{name} must be longer than 0 s and at most 365 days, got {v} ms"
                ));
            }
        }
        if !self.aging_cap.is_finite() || !(1.0..=1000.0).contains(&self.aging_cap) {
            return Err(format!(
                "aging_cap must be from 1 to 1000, got {}",
                self.aging_cap
            ));
        }
        for (name, v) in [
            ("floors.scheduled", self.floors.scheduled),
            ("floors.background", self.floors.background),
        ] {
            if !v.is_finite() || !(0.0..=0.5).contains(&v) {
                return Err(format!("{name} must be from 0 to 0.5, got {v}"));
            }
        }
        if self.floors.scheduled + self.floors.background > 0.9 {
            return Err(format!(
                "floors.scheduled + floors.background must be at most 0.9 (urgent keeps the rest), got {}",
                self.floors.scheduled + self.floors.background
            ));
        }
        if !(1..=64).contains(&self.max_active) {
            return Err(format!(
                "max_active must be from 1 to 64, got {}",
                self.max_active
            ));
        }
        if self.max_small_active > 4096 {
            return Err(format!(
                "max_small_active must be from 0 to 4096, got {}",
                self.max_small_active
            ));
        }
        if self.small_bytes > 1 << 30 {
            return Err(format!(
                "small_transfer must be at most 1GiB, got {} bytes",
                self.small_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_named() {
        assert_eq!(Policy::default().check(), Ok(()));
        let bad = |p: Policy, name: &str| {
            let e = p.check().err().unwrap_or_default();
            assert!(e.starts_with(name), "{e}");
        };
        let year = 365 * 24 * 3600 * 1000;
        bad(
            Policy {
                urgent_for_ms: 0,
                ..Policy::default()
            },
            "urgent_for",
        );
        bad(
            Policy {
                urgent_for_ms: year + 1,
                ..Policy::default()
            },
            "urgent_for",
        );
        bad(
            Policy {
                severity_half_life_ms: 0,
                ..Policy::default()
            },
            "severity_half_life",
        );
        bad(
            Policy {
                aging_ms: year * 2,
                ..Policy::default()
            },
            "aging",
        );
        bad(
            Policy {
                aging_cap: f64::NAN,
                ..Policy::default()
            },
            "aging_cap",
        );
        bad(
            Policy {
                floors: Floors {
                    scheduled: 0.5,
                    background: 0.5,
                },
                ..Policy::default()
            },
            "floors.scheduled + floors.background",
        );
        bad(
            Policy {
                max_active: 0,
                ..Policy::default()
            },
            "max_active",
        );
        bad(
            Policy {
                max_small_active: 5000,
                ..Policy::default()
            },
            "max_small_active",
        );
        bad(
            Policy {
                small_bytes: 2 << 30,
                ..Policy::default()
            },
            "small_transfer",
        );
    }
}
