//! The score of a transfer within its class, term by term (ARCHITECTURE.md
//! "Classes and score"), the live severity of a job's signals, and the
//! effective class of a transfer promoted by a signal.

use serde::Serialize;

use crate::{Class, Policy};

/// Parameters at which the model-size term is 1 (one billion).
pub const SIZE_REFERENCE_PARAMS: f64 = 1e9;

/// Smallest value of the model-size term, so that a tiny model (or a large
/// negative weight of the log) still gets a positive share.
pub const MIN_SIZE_TERM: f64 = 0.1;

/// A score and its terms; `value` is their product.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, utoipa::ToSchema)]
pub struct Score {
    /// The product of the four terms, > 0.
    pub value: f64,
    /// `max(1 + a x log10(model_parameters / 1e9), 0.1)`; 1 when the model
    /// size is unknown.
    pub size: f64,
    /// `1 + b x importance`.
    pub importance: f64,
    /// `1 + c x severity(t)`.
    pub severity: f64,
    /// `min(1 + waiting / T, cap)`.
    pub aging: f64,
}

/// What a score is computed from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreInputs {
    /// Model parameters of the job; `None` (or <= 0) when unknown.
    pub model_params: Option<f64>,
    /// Importance 0..1 (the transfer's override, else the job's); values
    /// outside are clamped.
    pub importance: f64,
    /// Live severity 0..1 of the job's signals (see [`severity`]).
    pub severity: f64,
    /// How long the transfer has been queued, ms.
    pub waiting_ms: u64,
}

/// The score of a transfer with `inputs` under `policy`. Never NaN, never
/// <= 0: non-finite inputs count as unknown (size) or 0.
pub fn score(policy: &Policy, inputs: ScoreInputs) -> Score {
    let w = &policy.weights;
    let size = match inputs.model_params {
        Some(p) if p.is_finite() && p > 0.0 => {
            (1.0 + w.size * (p / SIZE_REFERENCE_PARAMS).log10()).max(MIN_SIZE_TERM)
        }
        _ => 1.0,
    };
    let clamp01 = |v: f64| {
        if v.is_finite() {
            v.clamp(0.0, 1.0)
        } else {
            0.0
        }
    };
    let importance = 1.0 + w.importance * clamp01(inputs.importance);
    let severity = 1.0 + w.severity * clamp01(inputs.severity);
    let aging = (1.0 + inputs.waiting_ms as f64 / policy.aging_ms.max(1) as f64)
        .min(policy.aging_cap.max(1.0));
    Score {
        value: size * importance * severity * aging,
        size,
        importance,
        severity,
        aging,
    }
}

/// The live severity of a job at `now_ms`: the largest of its signals'
/// severities, each halved every `severity_half_life_ms` since it was
/// received. Signals are `(severity 0..1, received Unix ms)`; a signal
/// stamped in the future counts as received now. Result 0..1.
pub fn severity(
    policy: &Policy,
    signals: impl IntoIterator<Item = (f64, i64)>,
    now_ms: i64,
) -> f64 {
    let half = policy.severity_half_life_ms.max(1) as f64;
    signals
        .into_iter()
        .map(|(s, at)| {
            let s = if s.is_finite() {
                s.clamp(0.0, 1.0)
            } else {
                0.0
            };
            let age = now_ms.saturating_sub(at).max(0) as f64;
            s * 0.5f64.powf(age / half)
        })
        .fold(0.0, f64::max)
}

/// The class a transfer runs in at `now_ms`: `urgent` while a signal's
/// promotion lasts (`urgent_until`, Unix ms), else its own `class`.
pub fn effective_class(class: Class, urgent_until: Option<i64>, now_ms: i64) -> Class {
    match urgent_until {
        Some(u) if now_ms < u => Class::Urgent,
        _ => class,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn s(params: Option<f64>, importance: f64, severity: f64, waiting_ms: u64) -> Score {
        score(
            &Policy::default(),
            ScoreInputs {
                model_params: params,
                importance,
                severity,
                waiting_ms,
            },
        )
    }

    #[test]
    fn each_term_visibly_changes_the_score_with_the_defaults() {
        let base = s(Some(7e9), 0.0, 0.0, 0);
        // 10x the parameters: 1 + 0.5 x log10(70) vs 1 + 0.5 x log10(7).
        let big = s(Some(7e10), 0.0, 0.0, 0);
        assert!((big.value / base.value - 1.922 / 1.4225).abs() < 0.01);
        assert!((s(Some(7e9), 1.0, 0.0, 0).value / base.value - 2.0).abs() < 1e-9);
        assert!((s(Some(7e9), 0.0, 1.0, 0).value / base.value - 3.0).abs() < 1e-9);
        // Aging: +1 per T, capped at 2.
        assert!((s(Some(7e9), 0.0, 0.0, 300_000).aging - 1.5).abs() < 1e-9);
        assert_eq!(s(Some(7e9), 0.0, 0.0, 10_000_000).aging, 2.0);
        let b = s(Some(7e10), 0.5, 0.5, 60_000);
        assert!((b.value - b.size * b.importance * b.severity * b.aging).abs() < 1e-9);
    }

    #[test]
    fn odd_inputs_give_a_positive_finite_score() {
        for p in [
            None,
            Some(0.0),
            Some(-5.0),
            Some(f64::NAN),
            Some(1.0),
            Some(f64::INFINITY),
        ] {
            for x in [f64::NAN, -1.0, 7.0] {
                let v = s(p, x, x, 0).value;
                assert!(v.is_finite() && v > 0.0, "{p:?} {x}: {v}");
            }
        }
        assert_eq!(s(None, 0.0, 0.0, 0).size, 1.0);
        assert_eq!(s(Some(1.0), 0.0, 0.0, 0).size, MIN_SIZE_TERM);
    }

    #[test]
    fn severity_halves_every_half_life_and_the_largest_signal_counts() {
        let p = Policy::default();
        let h = p.severity_half_life_ms as i64;
        assert_eq!(severity(&p, [], 0), 0.0);
        assert!((severity(&p, [(0.8, 0)], h) - 0.4).abs() < 1e-9);
        assert!((severity(&p, [(0.8, 0), (0.5, h)], h) - 0.5).abs() < 1e-9);
        assert_eq!(severity(&p, [(3.0, 10)], 0), 1.0);
    }

    #[test]
    fn promotion_lasts_until_its_end() {
        assert_eq!(
            effective_class(Class::Background, Some(100), 99),
            Class::Urgent
        );
        assert_eq!(
            effective_class(Class::Background, Some(100), 100),
            Class::Background
        );
        assert_eq!(effective_class(Class::Scheduled, None, 5), Class::Scheduled);
    }
}
