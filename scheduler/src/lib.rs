//! Ferry's scheduler: pure logic, no sockets, files, SQL or tokio; time is
//! passed in (Unix milliseconds).
//!
//! - [`score`]: a transfer's score within its class, term by term, from
//!   model size, importance, live signal severity and aging (ARCHITECTURE.md
//!   "Classes and score"); [`severity`] decays signals with a half-life;
//!   [`effective_class`] applies a signal's promotion to `urgent`.
//! - [`LinkScheduler`]: one link's dispatcher. It is told which transfers
//!   are active and which of their chunks are ready, and decides which
//!   chunk goes next with what QUIC stream priority, under the class
//!   floors, the shares by score and the link's rate cap; it also ranks
//!   queued transfers for admission.
//! - [`Policy`]: the settings, `priority` or `fifo`.
//! - [`deadline`]: the fluid model's ready times, the admission answer to
//!   a deadline ([`Admission`]) and when a class serves deadlines first.
//! - [`trace`]: the trace format (JSON lines) of a recorded or generated
//!   workload; [`replay`] runs one through the real [`LinkScheduler`] on
//!   a simulated link (`ferry replay`), with generated [`replay::preset`]s.

use std::fmt;
use std::str::FromStr;

pub mod deadline;
mod link;
mod policy;
pub mod replay;
mod score;
pub mod trace;

pub use deadline::{Admission, Outlook};
pub use link::{
    priority, Decision, Explanation, LinkScheduler, PoolShare, Transfer, DEFAULT_CHUNK_BYTES,
    SCORE_REFRESH_MS,
};
pub use policy::{Floors, Policy, PolicyKind, Weights};
pub use score::{
    effective_class, score, severity, Score, ScoreInputs, MIN_SIZE_TERM, SIZE_REFERENCE_PARAMS,
};

/// The scheduler's coarse tiers, strictly ordered: `Urgent` before
/// `Scheduled` before `Background` (ARCHITECTURE.md, "Vocabulary").
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    /// An eval is waiting (e.g. after a loss spike).
    Urgent,
    /// Regular checkpoint replication.
    Scheduled,
    /// Datasets, logs, archives.
    Background,
}

impl Class {
    /// The class's name as used in config, API and catalog.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::Urgent => "urgent",
            Class::Scheduled => "scheduled",
            Class::Background => "background",
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A class name that is not `urgent`, `scheduled` or `background`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownClass(pub String);

impl fmt::Display for UnknownClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown class {:?} (expected urgent, scheduled or background)",
            self.0
        )
    }
}

impl std::error::Error for UnknownClass {}

impl FromStr for Class {
    type Err = UnknownClass;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "urgent" => Ok(Class::Urgent),
            "scheduled" => Ok(Class::Scheduled),
            "background" => Ok(Class::Background),
            other => Err(UnknownClass(other.to_string())),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn class_names_roundtrip_and_bad_names_are_named() {
        for k in [Class::Urgent, Class::Scheduled, Class::Background] {
            assert_eq!(k.as_str().parse::<Class>(), Ok(k));
        }
        let e = "soon".parse::<Class>().unwrap_err();
        assert!(e.to_string().contains("\"soon\""));
    }
}
