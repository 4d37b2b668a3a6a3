//! The trace format: a recorded or generated workload of one source agent,
//! as JSON lines, for `ferry replay` (ARCHITECTURE.md "Policy replay").
//!
//! Version 1. The first line is a [`Header`]: `{"ferry_trace": 1,
//! "links": [...], "jobs": [...], "chunk_bytes"?}` (the links' rate caps
//! and RTTs and the jobs' sizes and importances when the trace starts;
//! the chunk a generated trace should be replayed with). Every other line is one
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

/// Latest time a trace may hold, Unix ms (2100-01-01T00:00:00Z); times
/// start at 0.
pub const MAX_AT_MS: i64 = 4_102_444_800_000;
/// Largest transfer, bytes (10 PB).
pub const MAX_BYTES: u64 = 10_000_000_000_000_000;
/// Largest rate cap, bit/s (10 Tbit/s).
pub const MAX_RATE_BPS: u64 = 10_000_000_000_000;
/// Longest RTT, ms (10 minutes).
pub const MAX_RTT_MS: u64 = 600_000;

/// The first line of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// Format version, [`TRACE_VERSION`].
    pub ferry_trace: u32,
    /// The simulated chunk the replay should use, bytes, when the trace
    /// was made for one (a preset); `ferry replay --chunk` overrides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_bytes: Option<u64>,
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
    /// a link or job listed twice, an event earlier than the one before
    /// it, a transfer id that arrives twice or is changed before it
    /// arrives, a severity or importance outside 0..1, an arrival on a
    /// link the header does not list, and numbers out of range: times
    /// outside 0..[`MAX_AT_MS`], bytes above [`MAX_BYTES`], a rate outside
    /// 1..[`MAX_RATE_BPS`], an RTT above [`MAX_RTT_MS`], a negative or
    /// non-finite model size.
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        let text = text.strip_prefix('\u{feff}').unwrap_or(text);
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
                format!(
                    "not a trace header ({{\"ferry_trace\": 1, \"links\": [...]}}): {}",
                    json_error(&e)
                ),
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
        let mut seen = std::collections::HashSet::new();
        for l in &header.links {
            if !seen.insert(&l.link) {
                return Err(bad(hl, format!("link {:?} is listed twice", l.link)));
            }
            check_rate(l.rate_bps).map_err(|m| bad(hl, format!("link {:?}: {m}", l.link)))?;
            if l.rtt_ms > MAX_RTT_MS {
                return Err(bad(
                    hl,
                    format!(
                        "link {:?}: rtt_ms must be at most {MAX_RTT_MS}, got {}",
                        l.link, l.rtt_ms
                    ),
                ));
            }
        }
        let mut seen = std::collections::HashSet::new();
        for j in &header.jobs {
            if !seen.insert(&j.job) {
                return Err(bad(hl, format!("job {:?} is listed twice", j.job)));
            }
            check_job(j).map_err(|m| bad(hl, format!("job {:?}: {m}", j.job)))?;
        }
        if header.chunk_bytes == Some(0) {
            return Err(bad(hl, "chunk_bytes must be at least 1".into()));
        }
        let mut events = Vec::new();
        let mut known = std::collections::HashSet::new();
        let mut last = i64::MIN;
        for (n, l) in lines {
            let e: Event = serde_json::from_str(l).map_err(|e| bad(n, json_error(&e)))?;
            if !(0..=MAX_AT_MS).contains(&e.at_ms) {
                return Err(bad(
                    n,
                    format!(
                        "at_ms must be from 0 to {MAX_AT_MS} (Unix ms, before 2100), got {}",
                        e.at_ms
                    ),
                ));
            }
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
                    bytes,
                    deadline_ms,
                    ..
                } => {
                    on_link(link)?;
                    if *bytes > MAX_BYTES {
                        return Err(bad(
                            n,
                            format!("bytes must be at most {MAX_BYTES} (10 PB), got {bytes}"),
                        ));
                    }
                    if let Some(d) = deadline_ms.filter(|d| !(0..=MAX_AT_MS).contains(d)) {
                        return Err(bad(
                            n,
                            format!("deadline_ms must be from 0 to {MAX_AT_MS}, got {d}"),
                        ));
                    }
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
                What::Job(j) => check_job(j).map_err(|m| bad(n, m))?,
                What::Rate { link, rate_bps } => {
                    on_link(link)?;
                    check_rate(*rate_bps).map_err(|m| bad(n, m))?;
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

/// serde_json's message without its own "at line 1 column N" (each trace
/// line is parsed alone; the caller adds the trace's line number).
fn json_error(e: &serde_json::Error) -> String {
    let text = e.to_string();
    match text.rfind(" at line ") {
        Some(i) => format!("{} (column {})", &text[..i], e.column()),
        None => text,
    }
}

fn check_rate(rate: u64) -> Result<(), String> {
    if (1..=MAX_RATE_BPS).contains(&rate) {
        Ok(())
    } else {
        Err(format!(
            "rate_bps must be from 1 to {MAX_RATE_BPS} (10 Tbit/s), got {rate}"
        ))
    }
}

fn check_job(j: &JobSpec) -> Result<(), String> {
    check_unit(j.importance, "importance")?;
    match j.model_params {
        Some(p) if !p.is_finite() || p < 0.0 => Err(format!(
            "model_params must be a number of parameters, 0 or more, got {p}"
        )),
        _ => Ok(()),
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
        for (line, want) in [
            (
                r#"{"at_ms":-1,"event":"signal","job":"a","severity":0.5}"#,
                "at_ms must be from 0",
            ),
            (
                r#"{"at_ms":9223372036854775807,"event":"signal","job":"a","severity":0.5}"#,
                "at_ms must be from 0",
            ),
            (
                r#"{"at_ms":1,"event":"arrival","id":1,"link":"to-eval","bytes":18446744073709551615,"class":"urgent","job":"a"}"#,
                "bytes must be at most",
            ),
            (
                r#"{"at_ms":1,"event":"rate","link":"to-eval","rate_bps":0}"#,
                "rate_bps must be from 1",
            ),
            (
                r#"{"at_ms":1,"event":"job","job":"a","model_params":-1,"importance":0}"#,
                "model_params",
            ),
            (
                r#"{"at_ms":"0","event":"signal","job":"a","severity":0.5}"#,
                "expected i64 (column 12)",
            ),
        ] {
            let e = err(&format!("{head}\n{line}\n"));
            assert_eq!(e.line, 2, "{e}");
            assert!(e.to_string().contains(want), "{e}");
            assert!(!e.to_string().contains("at line 1"), "{e}");
        }
        for (h, want) in [
            (
                r#"{"ferry_trace":1,"links":[{"link":"l","rate_bps":1,"rtt_ms":1},{"link":"l","rate_bps":2,"rtt_ms":1}]}"#,
                "link \"l\" is listed twice",
            ),
            (
                r#"{"ferry_trace":1,"links":[{"link":"l","rate_bps":1,"rtt_ms":18446744073709551615}]}"#,
                "rtt_ms must be at most",
            ),
            (
                r#"{"ferry_trace":1,"jobs":[{"job":"j"},{"job":"j"}]}"#,
                "job \"j\" is listed twice",
            ),
        ] {
            let e = err(&format!("{h}\n"));
            assert_eq!(e.line, 1, "{e}");
            assert!(e.to_string().contains(want), "{e}");
        }
        // A byte-order mark is not an error.
        assert!(Trace::parse(&format!("\u{feff}{GOOD}")).is_ok());
    }
}
