//! The trace format: a recorded or generated workload of one source agent,
//! as JSON lines, for `ferry replay` (ARCHITECTURE.md "Policy replay").
//!
//! Version 1. The first line is a [`Header`]: `{"ferry_trace": 1,
//! "links": [...], "jobs": [...]}` (the links' rate caps and the jobs'
//! sizes and importances when the trace starts). Every other line is one
//! [`Event`]: `{"at_ms": <Unix ms>, "event": "<kind>", ...}`, in time
//! order. Kinds and their fields:
//!
//! | `event` | fields | what happened |
//! | --- | --- | --- |
//! | `arrival` | `id`, `link`, `bytes`, `class`, `job`, `importance`?, `deadline_ms`? | a transfer was queued (class and importance as they were then; `importance` is the transfer's own override, absent when the job's counts) |
//! | `class` | `id`, `class` | an operator changed a transfer's class |
//! | `importance` | `id`, `importance`? | an operator set (or with `null` cleared) a transfer's importance |
//! | `job` | `job`, `model_params`?, `importance` | a job's size or importance changed |
//! | `pause`, `resume`, `cancel` | `id` | an operator paused, resumed or cancelled a transfer |
//! | `rate` | `link`, `rate_bps` | a link's rate cap changed (bit/s) |
//! | `signal` | `job`, `severity`, `kind`? | a training controller reported an anomaly (severity 0..1) |
//!
//! Unknown fields are ignored, so a newer minor addition does not break an
//! older reader; a newer `ferry_trace` version is refused. Bytes are
//! payload bytes, rates bit/s, times Unix milliseconds.

use std::fmt;

use ferry_proto::state::TransferId;
use serde::{Deserialize, Serialize};

use crate::Class;

/// The trace format version this code writes and reads.
pub const TRACE_VERSION: u32 = 1;

/// The first line of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Format version, [`TRACE_VERSION`].
    pub ferry_trace: u32,
    /// The links and their rate caps when the trace starts.
    #[serde(default)]
    pub links: Vec<LinkSpec>,
    /// The jobs and their sizes and importances when the trace starts
    /// (jobs not listed have unknown size and importance 0 until a `job`
    /// event).
    #[serde(default)]
    pub jobs: Vec<JobSpec>,
}

/// A link at the start of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkSpec {
    /// Link name.
    pub link: String,
    /// Rate cap, bit/s (at least 1).
    pub rate_bps: u64,
    /// Base round-trip time, ms.
    pub rtt_ms: u64,
}

/// A job at the start of a trace (or changed by a `job` event).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobSpec {
    /// Job name.
    pub job: String,
    /// Model parameters, if known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_params: Option<f64>,
    /// Importance 0..1.
    #[serde(default)]
    pub importance: f64,
}

/// One line after the header: what happened, and when.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// When, Unix ms.
    pub at_ms: i64,
    /// What.
    #[serde(flatten)]
    pub what: What,
}

/// The kinds of [`Event`] (the `event` field).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum What {
    /// A transfer was queued.
    Arrival {
        /// Transfer id, unique in the trace.
        id: TransferId,
        /// Link it goes over.
        link: String,
        /// Payload bytes.
        bytes: u64,
        /// Class when queued.
        class: Class,
        /// Job.
        job: String,
        /// The transfer's own importance 0..1 (`None`: the job's counts).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        importance: Option<f64>,
        /// When it should be ready, Unix ms, if the client gave a deadline.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        deadline_ms: Option<i64>,
    },
    /// An operator changed a transfer's class.
    Class {
        /// Transfer id.
        id: TransferId,
        /// New class.
        class: Class,
    },
    /// An operator set or cleared a transfer's own importance.
    Importance {
        /// Transfer id.
        id: TransferId,
        /// New importance 0..1 (`None`: the job's counts again).
        #[serde(default)]
        importance: Option<f64>,
    },
    /// A job's size or importance changed.
    Job(JobSpec),
    /// An operator paused a transfer.
    Pause {
        /// Transfer id.
        id: TransferId,
    },
    /// An operator resumed a paused transfer.
    Resume {
        /// Transfer id.
        id: TransferId,
    },
    /// An operator cancelled a transfer.
    Cancel {
        /// Transfer id.
        id: TransferId,
    },
    /// A link's rate cap changed.
    Rate {
        /// Link name.
        link: String,
        /// New rate cap, bit/s.
        rate_bps: u64,
    },
    /// A training controller reported an anomaly.
    Signal {
        /// Job.
        job: String,
        /// Severity 0..1.
        severity: f64,
        /// What was seen (`loss_spike`, ...), informational.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        kind: Option<String>,
    },
}

/// A parsed trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// The first line.
    pub header: Header,
    /// The events, in time order.
    pub events: Vec<Event>,
}

/// What is wrong with a trace; `line` is 1-based.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceError {
    /// Line number (1 is the header), 0 for the trace as a whole.
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for TraceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line == 0 {
            write!(f, "{}", self.message)
        } else {
            write!(f, "line {}: {}", self.line, self.message)
        }
    }
}

impl std::error::Error for TraceError {}

impl Trace {
    /// Parses a trace from JSON lines. Blank lines are skipped.
    ///
    /// # Errors
    /// [`TraceError`] naming the first bad line: not JSON, a missing or
    /// mistyped field, an unknown `event`, a header of another version,
    /// an event earlier than the one before it, a transfer id that
    /// arrives twice or is changed before it arrives, a rate of 0, a
    /// severity or importance outside 0..1, an arrival on a link the
    /// header does not list.
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        let mut lines = text
            .lines()
            .enumerate()
            .map(|(i, l)| (i + 1, l))
            .filter(|(_, l)| !l.trim().is_empty());
        let (hl, first) = lines.next().ok_or(TraceError {
            line: 0,
            message:
                "the trace is empty (its first line must be a header: {\"ferry_trace\": 1, ...})"
                    .into(),
        })?;
        let bad = |line: usize, message: String| TraceError { line, message };
        let header: Header = serde_json::from_str(first).map_err(|e| {
            bad(
                hl,
                format!("not a trace header ({{\"ferry_trace\": 1, \"links\": [...]}}): {e}"),
            )
        })?;
        if header.ferry_trace != TRACE_VERSION {
            return Err(bad(
                hl,
                format!(
                    "trace format version {} is not supported (this ferry reads version {TRACE_VERSION})",
                    header.ferry_trace
                ),
            ));
        }
        for l in &header.links {
            if l.rate_bps == 0 {
                return Err(bad(
                    hl,
                    format!("link {:?}: rate_bps must be at least 1", l.link),
                ));
            }
        }
        for j in &header.jobs {
            check_unit(j.importance, "importance").map_err(|m| bad(hl, m))?;
        }
        let mut events = Vec::new();
        let mut known = std::collections::HashSet::new();
        let mut last = i64::MIN;
        for (n, l) in lines {
            let e: Event = serde_json::from_str(l).map_err(|e| bad(n, e.to_string()))?;
            if e.at_ms < last {
                return Err(bad(
                    n,
                    format!(
                        "at_ms {} is earlier than the line before ({last}): events must be in time order",
                        e.at_ms
                    ),
                ));
            }
            last = e.at_ms;
            let on_link = |link: &str| -> Result<(), TraceError> {
                if header.links.iter().any(|x| x.link == link) {
                    Ok(())
                } else {
                    Err(bad(
                        n,
                        format!("link {link:?} is not in the header's links"),
                    ))
                }
            };
            match &e.what {
                What::Arrival {
                    id,
                    link,
                    importance,
                    ..
                } => {
                    on_link(link)?;
                    if !known.insert(*id) {
                        return Err(bad(n, format!("transfer {id} arrives twice")));
                    }
                    if let Some(i) = importance {
                        check_unit(*i, "importance").map_err(|m| bad(n, m))?;
                    }
                }
                What::Class { id, .. }
                | What::Pause { id }
                | What::Resume { id }
                | What::Cancel { id } => {
                    if !known.contains(id) {
                        return Err(bad(n, format!("transfer {id} has not arrived")));
                    }
                }
                What::Importance { id, importance } => {
                    if !known.contains(id) {
                        return Err(bad(n, format!("transfer {id} has not arrived")));
                    }
                    if let Some(i) = importance {
                        check_unit(*i, "importance").map_err(|m| bad(n, m))?;
                    }
                }
                What::Job(j) => check_unit(j.importance, "importance").map_err(|m| bad(n, m))?,
                What::Rate { link, rate_bps } => {
                    on_link(link)?;
                    if *rate_bps == 0 {
                        return Err(bad(n, "rate_bps must be at least 1".into()));
                    }
                }
                What::Signal { severity, .. } => {
                    check_unit(*severity, "severity").map_err(|m| bad(n, m))?
                }
            }
            events.push(e);
        }
        Ok(Trace { header, events })
    }

    /// The trace as JSON lines (header first, one event per line, each
    /// line ending in `\n`); [`Trace::parse`] reads it back unchanged.
    pub fn to_json_lines(&self) -> String {
        let mut out = String::new();
        // Serializing these plain structs cannot fail.
        out.push_str(&serde_json::to_string(&self.header).unwrap_or_default());
        out.push('\n');
        for e in &self.events {
            out.push_str(&serde_json::to_string(e).unwrap_or_default());
            out.push('\n');
        }
        out
    }

    /// How many transfers arrive in the trace.
    pub fn arrivals(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e.what, What::Arrival { .. }))
            .count()
    }
}

fn check_unit(v: f64, name: &str) -> Result<(), String> {
    if v.is_finite() && (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(format!("{name} must be a number from 0 to 1, got {v}"))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"ferry_trace":1,"links":[{"link":"to-eval","rate_bps":1000000000,"rtt_ms":100}],"jobs":[{"job":"mm","model_params":7e10,"importance":0.5}]}
{"at_ms":0,"event":"arrival","id":1,"link":"to-eval","bytes":400000000,"class":"background","job":"archive"}
{"at_ms":3000,"event":"arrival","id":2,"link":"to-eval","bytes":300000000,"class":"scheduled","job":"mm","deadline_ms":60000}

{"at_ms":3001,"event":"signal","job":"mm","severity":0.9,"kind":"loss_spike"}
{"at_ms":4000,"event":"class","id":1,"class":"urgent"}
{"at_ms":4000,"event":"importance","id":1,"importance":null}
{"at_ms":4100,"event":"job","job":"mm","importance":1.0}
{"at_ms":5000,"event":"pause","id":1}
{"at_ms":6000,"event":"resume","id":1}
{"at_ms":7000,"event":"rate","link":"to-eval","rate_bps":500000000}
{"at_ms":8000,"event":"cancel","id":2}
"#;

    #[test]
    fn a_trace_reads_back_what_it_writes() {
        let t = Trace::parse(GOOD).unwrap();
        assert_eq!(t.events.len(), 10);
        assert_eq!(t.arrivals(), 2);
        assert_eq!(
            t.events[1].what,
            What::Arrival {
                id: TransferId(2),
                link: "to-eval".into(),
                bytes: 300_000_000,
                class: Class::Scheduled,
                job: "mm".into(),
                importance: None,
                deadline_ms: Some(60_000),
            }
        );
        let again = Trace::parse(&t.to_json_lines()).unwrap();
        assert_eq!(again, t);
    }

    #[test]
    fn bad_lines_are_named_by_number() {
        let err = |text: &str| Trace::parse(text).unwrap_err();
        let head = GOOD.lines().next().unwrap();
        let e = err(&format!("{head}\n{{\"at_ms\":1,\"event\":\"arrival\"\n"));
        assert_eq!(e.line, 2, "{e}");
        let e = err(&format!(
            "{head}\n\n{{\"at_ms\":1,\"event\":\"teleport\",\"id\":1}}\n"
        ));
        assert_eq!(e.line, 3);
        assert!(e.to_string().contains("teleport"), "{e}");
        let e = err(&format!(
            "{head}\n{{\"at_ms\":5,\"event\":\"signal\",\"job\":\"a\",\"severity\":0.5}}\n{{\"at_ms\":4,\"event\":\"signal\",\"job\":\"a\",\"severity\":0.5}}\n"
        ));
        assert_eq!(e.line, 3);
        assert!(e.to_string().contains("time order"), "{e}");
        let e = err(&format!(
            "{head}\n{{\"at_ms\":5,\"event\":\"pause\",\"id\":9}}\n"
        ));
        assert!(e.to_string().contains("transfer 9 has not arrived"), "{e}");
        let e = err(&format!(
            "{head}\n{{\"at_ms\":5,\"event\":\"signal\",\"job\":\"a\",\"severity\":1.5}}\n"
        ));
        assert!(e.to_string().contains("severity"), "{e}");
        let e = err(&format!(
            "{head}\n{{\"at_ms\":5,\"event\":\"arrival\",\"id\":1,\"link\":\"other\",\"bytes\":1,\"class\":\"urgent\",\"job\":\"a\"}}\n"
        ));
        assert!(e.to_string().contains("\"other\""), "{e}");
        let e = err("{\"ferry_trace\":2}\n");
        assert!(
            e.to_string().starts_with("line 1: trace format version 2"),
            "{e}"
        );
        assert_eq!(err("\n\n").line, 0);
    }
}
