//! Typed states, profiles and ids shared by the source, the sink, the
//! catalog and the API (ARCHITECTURE.md, "Vocabulary").
//!
//! Each enum has one spelling, its `as_str`, used in the catalog, the API,
//! logs and config; [`FromStr`] parses it back and names what was wrong.
//! Only the catalog and (de)serialisation convert; everything else
//! matches on the enum, so adding a state makes every missed `match` fail
//! to compile.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A name that is not one of an enum's spellings, e.g. a state read from a
/// catalog written by a newer version.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {got:?} (expected {expected})")]
pub struct UnknownName {
    /// What was being parsed, e.g. `transfer state`.
    pub what: &'static str,
    /// The text received.
    pub got: String,
    /// The accepted spellings, comma-separated.
    pub expected: &'static str,
}

/// Implements `as_str`, `ALL`, `Display` and `FromStr` for a fieldless
/// enum from one table of (variant, spelling).
macro_rules! names {
    ($ty:ident, $what:literal, $($variant:ident => $name:literal),+ $(,)?) => {
        impl $ty {
            /// Every value, in declaration order.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// The spelling used in the catalog, the API, logs and config.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $ty {
            type Err = UnknownName;
            fn from_str(s: &str) -> Result<Self, UnknownName> {
                match s {
                    $($name => Ok($ty::$variant),)+
                    other => Err(UnknownName {
                        what: $what,
                        got: other.chars().take(100).collect(),
                        expected: concat!($($name, " "),+),
                    }),
                }
            }
        }
    };
}

/// Where a transfer is: a source-side transfer row goes `queued` ->
/// `active` (<-> `paused`) -> `verifying` -> `published`, or ends `failed`
/// or `cancelled`; a sink-side row is `receiving` until it is
/// `published`, `failed` or `cancelled`, and a published replica that is
/// removed goes `removing` (out of the published namespace, its files
/// being deleted) -> `removed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TransferState {
    /// Waiting for its link.
    Queued,
    /// Chunks are moving.
    Active,
    /// Stopped on request (or by the scheduler) until resumed; not final:
    /// it alternates with `active` and is resumed after a restart like any
    /// unfinished transfer.
    Paused,
    /// All chunks sent; the sink is checking the manifest.
    Verifying,
    /// The replica is published at the sink.
    Published,
    /// Stopped by an error.
    Failed,
    /// Stopped on request.
    Cancelled,
    /// Sink side: chunks are arriving.
    Receiving,
    /// Sink side: a replica taken out of the published namespace (resolve
    /// no longer names it) whose files are being deleted; finished after a
    /// restart.
    Removing,
    /// Sink side: a replica removed (by its retention policy, space
    /// pressure or an operator); the row keeps the record.
    Removed,
}

names!(TransferState, "transfer state",
    Queued => "queued",
    Active => "active",
    Paused => "paused",
    Verifying => "verifying",
    Published => "published",
    Failed => "failed",
    Cancelled => "cancelled",
    Receiving => "receiving",
    Removing => "removing",
    Removed => "removed",
);

impl TransferState {
    /// The states a transfer never leaves (a sink-side replica may still
    /// be removed after it is published).
    pub const FINAL: [TransferState; 4] = [
        TransferState::Published,
        TransferState::Failed,
        TransferState::Cancelled,
        TransferState::Removed,
    ];

    /// True for the states a transfer never leaves ([`Self::FINAL`]).
    pub const fn is_final(self) -> bool {
        matches!(
            self,
            TransferState::Published
                | TransferState::Failed
                | TransferState::Cancelled
                | TransferState::Removed
        )
    }
}

/// A checkpoint's state at the source (ARCHITECTURE.md, "Vocabulary").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointState {
    /// A training controller said it is coming (`POST
    /// /v1/checkpoints/announce`); no byte has landed yet.
    Announced,
    /// Being written; the transfer streams what is complete so far.
    Open,
    /// The format's commit predicate holds; the manifest can be sealed.
    Committed,
    /// The writer gave up (idle timeout, or the format says so).
    Abandoned,
    /// The directory disappeared before it was committed.
    Deleted,
}

names!(CheckpointState, "checkpoint state",
    Announced => "announced",
    Open => "open",
    Committed => "committed",
    Abandoned => "abandoned",
    Deleted => "deleted",
);

/// Which files of a checkpoint are replicated.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// Every file.
    #[default]
    Full,
    /// Weights only: files that hold optimizer state are left out; refused
    /// for formats that keep both in one file (DCP, torch_dist).
    WeightsOnly,
    /// Every file, weights first (a source root's `publish =
    /// "weights-first"`): metadata and weight files cross first, and at
    /// the commit the sink publishes a [`Profile::WeightsOnly`] version
    /// of them while the optimizer state still moves; the full replica
    /// replaces it as a new version. Only a transfer carries it (on the
    /// wire from [`crate::wire::WEIGHTS_FIRST_VERSION`]); the sink's
    /// replicas are `full` and `weights-only`.
    WeightsFirst,
}

names!(Profile, "replication profile",
    Full => "full",
    WeightsOnly => "weights-only",
    WeightsFirst => "weights-first",
);

impl Profile {
    /// The name carried in the catalog's `profile` column and on the wire
    /// ([`crate::wire::TransferKey::profile`]): `None` (empty on the wire)
    /// for [`Profile::Full`], which predates profiles.
    pub const fn stored_name(self) -> Option<&'static str> {
        match self {
            Profile::Full => None,
            Profile::WeightsOnly => Some("weights-only"),
            Profile::WeightsFirst => Some("weights-first"),
        }
    }

    /// Parses a stored or wire name: `None` or empty is [`Profile::Full`].
    ///
    /// # Errors
    /// [`UnknownName`] for any other unknown name.
    pub fn from_stored(name: Option<&str>) -> Result<Profile, UnknownName> {
        match name {
            None | Some("") => Ok(Profile::Full),
            Some(n) => n.parse(),
        }
    }
}

/// A transfer's id, assigned by the source (its catalog row id) and
/// carried on the wire, so both ends name a transfer the same way.
/// Always positive and below 2^63 (a SQL `BIGINT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct TransferId(pub u64);

impl TransferId {
    /// The id as stored in a SQL `BIGINT` column.
    pub const fn as_i64(self) -> i64 {
        self.0 as i64
    }

    /// An id read from a SQL `BIGINT` column; `None` if negative.
    pub fn from_i64(v: i64) -> Option<TransferId> {
        u64::try_from(v).ok().map(TransferId)
    }
}

impl fmt::Display for TransferId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn every_name_roundtrips_and_serde_agrees_with_as_str() {
        for s in TransferState::ALL {
            assert_eq!(s.as_str().parse::<TransferState>().unwrap(), *s);
            let json = format!("\"{}\"", s.as_str());
            assert_eq!(serde_json::to_string(s).unwrap(), json);
            assert_eq!(serde_json::from_str::<TransferState>(&json).unwrap(), *s);
        }
        for s in CheckpointState::ALL {
            assert_eq!(s.as_str().parse::<CheckpointState>().unwrap(), *s);
        }
        for p in Profile::ALL {
            assert_eq!(p.as_str().parse::<Profile>().unwrap(), *p);
            let json = format!("\"{}\"", p.as_str());
            assert_eq!(serde_json::to_string(p).unwrap(), json);
            assert_eq!(Profile::from_stored(p.stored_name()).unwrap(), *p);
        }
        assert_eq!(Profile::from_stored(Some("")).unwrap(), Profile::Full);
    }

    #[test]
    fn unknown_names_are_named() {
        let e = "sleeping".parse::<TransferState>().unwrap_err();
        assert_eq!(e.what, "transfer state");
        assert!(e.to_string().contains("\"sleeping\""), "{e}");
        assert!(e.to_string().contains("queued"), "{e}");
        let e = Profile::from_stored(Some("tiny")).unwrap_err();
        assert!(e.to_string().contains("replication profile"), "{e}");
        assert!(TransferId::from_i64(-1).is_none());
        assert_eq!(TransferId::from_i64(7).unwrap().as_i64(), 7);
    }

    #[test]
    fn final_states_are_exactly_the_three() {
        let finals: Vec<_> = TransferState::ALL
            .iter()
            .filter(|s| s.is_final())
            .copied()
            .collect();
        assert_eq!(finals, TransferState::FINAL);
    }
}
