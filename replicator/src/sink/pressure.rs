//! Space pressure at the sink, without I/O: which published versions go,
//! and in which order, when the sink's free space falls below `min_free`
//! (`[sink]`, ARCHITECTURE.md "Replica lifecycle"). The driver in
//! `sink/lifecycle.rs` measures free space, removes what a policy already
//! expires, then removes the versions [`plan`] returns one by one,
//! measuring again after each, until free space is at least `target_free`
//! (or, for an incoming transfer, until it fits).
//!
//! A version may go under pressure unless it is pinned, a reader lease
//! holds it, it is the newest
//! of its (job, source site) (by step when every version of the group has
//! one, else by publish time, as in [`super::retention`]), or it is
//! younger than the `min_age` of the first policy matching its job. Those
//! that may go are taken by their class at publish (`background`, then
//! `scheduled`, then `urgent`; a version from a source too old to send its
//! class counts as `scheduled`), oldest first.

use std::collections::{BTreeMap, HashMap};

use scheduler::Class;

use super::retention::{RetentionPolicy, Version};

/// A free-space threshold of `[sink]`: bytes, or a share of the sink file
/// system's capacity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Threshold {
    /// A number of bytes (`"50GB"`).
    Bytes(u64),
    /// A share of the capacity, in percent, above 0 and below 100
    /// (`"10%"`).
    Percent(f64),
}

impl Threshold {
    /// Parses `"10%"` (a percentage of capacity) or a size (`"50GB"`,
    /// `"1.5TiB"`, as [`ferry_proto::units::parse_size`]).
    ///
    /// # Errors
    /// A message saying what was expected.
    pub fn parse(s: &str) -> Result<Threshold, String> {
        let t = s.trim();
        if let Some(p) = t.strip_suffix('%') {
            let v: f64 = p.trim().parse().map_err(|_| {
                format!("{s:?} is not a percentage; expected a size (\"50GB\") or \"10%\"")
            })?;
            if !(v > 0.0 && v < 100.0) {
                return Err(format!(
                    "{s:?}: a percentage of capacity must be above 0 and below 100"
                ));
            }
            return Ok(Threshold::Percent(v));
        }
        ferry_proto::units::parse_size(t)
            .map(Threshold::Bytes)
            .map_err(|e| {
                format!("{e}; expected a size (\"50GB\") or a percentage of capacity (\"10%\")")
            })
    }

    /// The threshold in bytes for a file system of `capacity` bytes;
    /// `None` for a percentage when the capacity is unknown.
    pub fn bytes(&self, capacity: Option<u64>) -> Option<u64> {
        match *self {
            Threshold::Bytes(b) => Some(b),
            Threshold::Percent(p) => capacity.map(|c| (c as f64 * p / 100.0) as u64),
        }
    }
}

impl std::fmt::Display for Threshold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Threshold::Bytes(b) => write!(f, "{b} bytes"),
            Threshold::Percent(p) => write!(f, "{p}% of capacity"),
        }
    }
}

/// `[sink] min_free` and `target_free`: below `min_free` bytes free, the
/// sink removes replicas until `target_free` bytes are free.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpacePressure {
    /// Below this, removal starts.
    pub min_free: Threshold,
    /// Removal goes on until this much is free.
    pub target_free: Threshold,
}

impl SpacePressure {
    /// Both thresholds in bytes for a file system of `capacity` bytes
    /// keeping `reserve` bytes free: (min_free, target_free), the target
    /// at least `min_free`.
    ///
    /// # Errors
    /// A message naming the key when a threshold is a percentage and the
    /// capacity is unknown, or when a threshold is not above `reserve`.
    pub fn bytes(&self, capacity: Option<u64>, reserve: u64) -> Result<(u64, u64), String> {
        let each = |key: &str, t: Threshold| {
            let b = t.bytes(capacity).ok_or_else(|| {
                format!("sink.{key} = {t}: the sink's storage does not report its capacity; give a size")
            })?;
            if b <= reserve {
                return Err(format!(
                    "sink.{key} = {t} ({b} bytes) must be above sink.reserve ({reserve} bytes)"
                ));
            }
            Ok(b)
        };
        let min = each("min_free", self.min_free)?;
        let target = each("target_free", self.target_free)?;
        Ok((min, target.max(min)))
    }
}

/// Why a version cannot go under pressure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protected {
    /// Pinned.
    Pinned,
    /// Held by a reader lease.
    Leased,
    /// The newest of its (job, source site).
    Newest,
    /// Younger than its policy's `min_age`.
    Young,
}

impl Protected {
    /// Its name in messages: `pinned`, `its job's newest`, `younger than min_age`.
    pub fn as_str(self) -> &'static str {
        match self {
            Protected::Pinned => "pinned",
            Protected::Leased => "leased",
            Protected::Newest => "its job's newest",
            Protected::Young => "younger than min_age",
        }
    }
}

/// What [`plan`] chose.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Plan {
    /// Row ids to remove, in order.
    pub remove: Vec<i64>,
    /// Bytes that removing them frees: files no remaining version shares.
    pub freed: u64,
    /// How many versions are protected, by why.
    pub protected: BTreeMap<Protected, usize>,
}

impl Plan {
    /// The protected versions in words: `2 pinned, 1 its job's newest`.
    pub fn protected_text(&self) -> String {
        if self.protected.is_empty() {
            return "no replica is kept back".into();
        }
        self.protected
            .iter()
            .map(|(p, n)| format!("{n} {}", p.as_str()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The rank of a class at publish in removal order (lowest goes first).
fn class_rank(c: Option<Class>) -> u8 {
    match c.unwrap_or(Class::Scheduled) {
        Class::Background => 0,
        Class::Scheduled => 1,
        Class::Urgent => 2,
    }
}

/// The versions to remove, in order, until `need` bytes are freed (all
/// that may go when they free less), at time `now_ms` (Unix ms), with
/// `classes[i]` the class at publish of `versions[i]`. A file counts as
/// freed when the last version holding it (by its identity: hard links
/// count once) is removed.
pub fn plan(
    policies: &[RetentionPolicy],
    versions: &[Version],
    classes: &[Option<Class>],
    now_ms: i64,
    need: u64,
) -> Plan {
    // The newest of each (job, source site).
    let mut groups: HashMap<(&str, &str), Vec<usize>> = HashMap::new();
    for (i, v) in versions.iter().enumerate() {
        groups
            .entry((v.job.as_str(), v.source_site.as_str()))
            .or_default()
            .push(i);
    }
    let mut newest = vec![false; versions.len()];
    for members in groups.values() {
        let by_step = members.iter().all(|&i| versions[i].step.is_some());
        let key = |i: usize| {
            let v = &versions[i];
            (
                if by_step { v.step.unwrap_or(0) } else { 0 },
                v.published_ms,
                v.id,
            )
        };
        if let Some(&top) = members.iter().max_by_key(|&&i| key(i)) {
            newest[top] = true;
        }
    }
    let mut out = Plan::default();
    let mut candidates = Vec::new();
    for (i, v) in versions.iter().enumerate() {
        let min_age = policies
            .iter()
            .find(|p| p.matches(&v.job))
            .and_then(|p| p.min_age);
        let why = if v.pinned {
            Some(Protected::Pinned)
        } else if v.leased {
            Some(Protected::Leased)
        } else if newest[i] {
            Some(Protected::Newest)
        } else if min_age.is_some_and(|m| {
            i128::from(now_ms.saturating_sub(v.published_ms)) < m.as_millis() as i128
        }) {
            Some(Protected::Young)
        } else {
            None
        };
        match why {
            Some(p) => *out.protected.entry(p).or_default() += 1,
            None => candidates.push(i),
        }
    }
    candidates.sort_by_key(|&i| {
        (
            class_rank(classes.get(i).copied().flatten()),
            versions[i].published_ms,
            versions[i].id,
        )
    });
    // How many versions hold each file.
    let mut holders: HashMap<(u64, u64), (usize, u64)> = HashMap::new();
    for v in versions {
        for (id, bytes) in &v.files {
            let e = holders.entry(*id).or_insert((0, *bytes));
            e.0 += 1;
        }
    }
    for i in candidates {
        if out.freed >= need {
            break;
        }
        for (id, _) in &versions[i].files {
            if let Some(e) = holders.get_mut(id) {
                e.0 -= 1;
                if e.0 == 0 {
                    out.freed = out.freed.saturating_add(e.1);
                }
            }
        }
        out.remove.push(versions[i].id);
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::time::Duration;

    const MIN: i64 = 60_000;
    const NOW: i64 = 1_800_000_000_000;

    /// Version `id` of `job` at `step`, published `age_min` minutes ago,
    /// one file of its own of `bytes`.
    fn v(id: i64, job: &str, step: u64, age_min: i64, bytes: u64) -> Version {
        Version {
            id,
            job: job.into(),
            source_site: "a".into(),
            step: Some(step),
            published_ms: NOW - age_min * MIN,
            files: vec![((id as u64, 1), bytes)],
            pinned: false,
            leased: false,
        }
    }

    #[test]
    fn thresholds_parse_sizes_and_percentages_and_name_bad_ones() {
        assert_eq!(
            Threshold::parse("50GB").unwrap(),
            Threshold::Bytes(50_000_000_000)
        );
        assert_eq!(Threshold::parse("10%").unwrap(), Threshold::Percent(10.0));
        assert_eq!(
            Threshold::parse("10%").unwrap().bytes(Some(1000)),
            Some(100)
        );
        assert_eq!(Threshold::parse("10%").unwrap().bytes(None), None);
        for bad in ["0%", "100%", "-5%", "x%", "lots"] {
            let e = Threshold::parse(bad).unwrap_err();
            assert!(
                e.contains(bad.trim_end_matches('%')) || e.contains("size"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn thresholds_must_be_above_the_reserve_and_known() {
        let p = SpacePressure {
            min_free: Threshold::Percent(10.0),
            target_free: Threshold::Bytes(50),
        };
        // The target is raised to min_free.
        assert_eq!(p.bytes(Some(1000), 10), Ok((100, 100)));
        let e = p.bytes(Some(1000), 100).unwrap_err();
        assert!(
            e.contains("sink.min_free") && e.contains("sink.reserve"),
            "{e}"
        );
        let e = p.bytes(None, 0).unwrap_err();
        assert!(e.contains("sink.min_free") && e.contains("capacity"), "{e}");
    }

    #[test]
    fn background_goes_before_scheduled_before_urgent_oldest_first() {
        let vs = vec![
            v(1, "j", 100, 50, 10),
            v(2, "j", 200, 40, 10),
            v(3, "j", 300, 30, 10),
            v(4, "j", 400, 20, 10),
            v(5, "j", 500, 10, 10),
        ];
        let classes = [
            Some(Class::Urgent),
            Some(Class::Scheduled),
            Some(Class::Background),
            None,
            Some(Class::Background),
        ];
        let p = plan(&[], &vs, &classes, NOW, u64::MAX);
        // 5 is the newest and stays; 3 (background), then 2 and 4
        // (scheduled, oldest first), then 1 (urgent).
        assert_eq!(p.remove, vec![3, 2, 4, 1]);
        assert_eq!(p.freed, 40);
        assert_eq!(p.protected.get(&Protected::Newest), Some(&1));
        // Only what is needed.
        let p = plan(&[], &vs, &classes, NOW, 15);
        assert_eq!(p.remove, vec![3, 2]);
        assert_eq!(p.freed, 20);
    }

    #[test]
    fn pinned_young_and_newest_never_go() {
        let policy = RetentionPolicy::new(
            "young-*",
            None,
            None,
            Some(Duration::from_secs(3600)),
            None,
            false,
        )
        .unwrap();
        let mut vs = vec![
            v(1, "j", 100, 500, 10),
            v(2, "j", 200, 400, 10),
            v(3, "young-x", 1, 30, 10),
            v(4, "young-x", 2, 20, 10),
            v(5, "other", 7, 900, 10),
        ];
        vs[0].pinned = true;
        let p = plan(&[policy], &vs, &[None; 5], NOW, u64::MAX);
        assert!(p.remove.is_empty(), "{p:?}");
        assert_eq!(p.freed, 0);
        assert_eq!(p.protected.get(&Protected::Pinned), Some(&1));
        assert_eq!(p.protected.get(&Protected::Newest), Some(&3));
        assert_eq!(p.protected.get(&Protected::Young), Some(&1));
        assert_eq!(
            p.protected_text(),
            "1 pinned, 3 its job's newest, 1 younger than min_age"
        );
    }

    #[test]
    fn a_leased_version_never_goes() {
        let mut vs = vec![
            v(1, "j", 100, 500, 10),
            v(2, "j", 200, 400, 10),
            v(3, "j", 300, 300, 10),
        ];
        vs[0].leased = true;
        let p = plan(&[], &vs, &[None; 3], NOW, u64::MAX);
        assert_eq!(p.remove, vec![2]);
        assert_eq!(p.protected_text(), "1 leased, 1 its job's newest");
    }

    #[test]
    fn a_file_shared_with_a_kept_version_frees_nothing() {
        let mut old = v(1, "j", 100, 50, 10);
        let new = Version {
            files: vec![((1, 1), 10), ((2, 1), 5)],
            ..v(2, "j", 200, 40, 0)
        };
        old.files.push(((3, 1), 7));
        let p = plan(&[], &[old, new], &[None; 2], NOW, u64::MAX);
        assert_eq!(p.remove, vec![1]);
        // File (1, 1) is a hard link the newest keeps: only (3, 1) goes.
        assert_eq!(p.freed, 7);
    }
}
