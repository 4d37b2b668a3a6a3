//! The sink's retention policy, without I/O: which published replica
//! versions a `[[sink.retention]]` policy keeps and which expire. The
//! versions, their pins and the time are passed in; the driver in
//! `sink/lifecycle.rs` reads the catalog and the storage, calls
//! [`evaluate`] and removes what it returns (ARCHITECTURE.md, "Replica
//! lifecycle").
//!
//! The rules, per (job, source site) group of versions under the first
//! policy whose `job` glob matches the job:
//!
//! 1. A version is *kept* if it is pinned, younger than `min_age`, among
//!    the newest `keep_last` of its group, its step is a multiple of
//!    `keep_every`, or a reader lease holds it. An unset `keep_last` means
//!    unlimited (every version is among the newest), so `keep_every` and
//!    `min_age` only matter beside a `keep_last` (or protect from
//!    `max_bytes`). A lease is weighed last: a version kept only by a
//!    lease is one of the newest `keep_last` only by its rank, and the
//!    ranks of newer versions do not change for it.
//! 2. Then, while the group holds more than `max_bytes` (each file
//!    counted once, hard links included), its oldest version kept only by
//!    `keep_last` or `keep_every` and not leased expires; never the
//!    group's newest, so a
//!    `max_bytes` below one checkpoint's size keeps the newest one alone
//!    rather than removing every replica as soon as it is published.
//! 3. All other versions expire.
//!
//! "Newest" and "oldest" order a group by step when every version of the
//! group has one (publish time breaks ties), else by publish time. A job
//! no policy matches keeps everything.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use ferry_proto::wire::PinTarget;
use globset::{Glob, GlobMatcher};

/// A retention policy: `[[sink.retention]]` in the config.
#[derive(Debug, Clone)]
pub struct RetentionPolicy {
    /// The `job` glob as written (`*`, `llama-*`).
    pub job: String,
    matcher: GlobMatcher,
    /// Keep the newest this many versions per (job, source site); `None`:
    /// unlimited.
    pub keep_last: Option<u32>,
    /// Keep versions whose step is a multiple of this (steps, > 0).
    pub keep_every: Option<u64>,
    /// Keep versions published less than this long ago.
    pub min_age: Option<Duration>,
    /// Expire the oldest versions kept only by `keep_last` or `keep_every`
    /// while a (job, source site) holds more than this many bytes.
    pub max_bytes: Option<u64>,
    /// Report what would expire and remove nothing.
    pub dry_run: bool,
}

impl RetentionPolicy {
    /// A policy for jobs matching the glob `job`.
    ///
    /// # Errors
    /// A message naming the bad key: a glob that does not parse, a policy
    /// that sets none of `keep_last`, `keep_every`, `min_age`,
    /// `max_bytes`, or a `keep_last` or `keep_every` of 0.
    pub fn new(
        job: &str,
        keep_last: Option<u32>,
        keep_every: Option<u64>,
        min_age: Option<Duration>,
        max_bytes: Option<u64>,
        dry_run: bool,
    ) -> Result<RetentionPolicy, String> {
        let matcher = Glob::new(job)
            .map_err(|e| format!("job glob {job:?}: {e}"))?
            .compile_matcher();
        if keep_last.is_none() && keep_every.is_none() && min_age.is_none() && max_bytes.is_none() {
            return Err(format!(
                "the policy for job {job:?} sets none of keep_last, keep_every, min_age, \
                 max_bytes: it would keep everything; set at least one"
            ));
        }
        if keep_last == Some(0) {
            return Err(format!(
                "keep_last of the policy for job {job:?} must be 1 or more (0 would remove \
                 every replica as soon as it is published; leave it unset for no limit)"
            ));
        }
        if keep_every == Some(0) {
            return Err(format!(
                "keep_every of the policy for job {job:?} must be 1 or more"
            ));
        }
        Ok(RetentionPolicy {
            job: job.to_string(),
            matcher,
            keep_last,
            keep_every,
            min_age,
            max_bytes,
            dry_run,
        })
    }

    /// Whether the policy can never expire anything: it sets neither
    /// `keep_last` nor `max_bytes`, so `keep_every` and `min_age` only
    /// add to an unlimited `keep_last` (the agent warns at start).
    pub fn keeps_everything(&self) -> bool {
        self.keep_last.is_none() && self.max_bytes.is_none()
    }

    /// Whether the policy applies to `job`.
    pub fn matches(&self, job: &str) -> bool {
        self.matcher.is_match(job)
    }

    /// The policy in one line, for logs and removal records:
    /// `job "llama-*": keep_last 2, max_bytes 1000000`.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(n) = self.keep_last {
            parts.push(format!("keep_last {n}"));
        }
        if let Some(n) = self.keep_every {
            parts.push(format!("keep_every {n}"));
        }
        if let Some(d) = self.min_age {
            parts.push(format!("min_age {}", humantime::format_duration(d)));
        }
        if let Some(b) = self.max_bytes {
            parts.push(format!("max_bytes {b}"));
        }
        format!("job {:?}: {}", self.job, parts.join(", "))
    }
}

/// A retention policy as the API reads and writes it (`GET` and `PUT
/// /v1/retention`), with the config's keys.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PolicySpec {
    /// Glob over job names (`*`, `llama-*`); the first matching policy
    /// applies.
    pub job: String,
    /// Keep the newest this many versions per (job, source site); absent:
    /// unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_last: Option<u32>,
    /// Keep versions whose step is a multiple of this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_every: Option<u64>,
    /// Keep versions published less than this long ago (`1h`, `2d`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_age: Option<String>,
    /// Expire the oldest versions kept only by `keep_last` or
    /// `keep_every` while a (job, source site) holds more than this
    /// (`2TB`, `500GiB`, or bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<String>,
    /// Report what would expire and remove nothing.
    #[serde(default)]
    pub dry_run: bool,
}

impl PolicySpec {
    /// The policy it describes.
    ///
    /// # Errors
    /// A message naming the bad key (as [`RetentionPolicy::new`], and a
    /// `min_age` or `max_bytes` that does not parse).
    pub fn policy(&self) -> Result<RetentionPolicy, String> {
        let min_age =
            match &self.min_age {
                None => None,
                Some(t) => Some(humantime::parse_duration(t.trim()).map_err(|e| {
                    format!("min_age {t:?} of the policy for job {:?}: {e}", self.job)
                })?),
            };
        let max_bytes = match &self.max_bytes {
            None => None,
            Some(t) => Some(ferry_proto::units::parse_size(t.trim()).map_err(|e| {
                format!("max_bytes {t:?} of the policy for job {:?}: {e}", self.job)
            })?),
        };
        RetentionPolicy::new(
            &self.job,
            self.keep_last,
            self.keep_every,
            min_age,
            max_bytes,
            self.dry_run,
        )
    }

    /// `p` as the API shows it.
    pub fn of(p: &RetentionPolicy) -> PolicySpec {
        PolicySpec {
            job: p.job.clone(),
            keep_last: p.keep_last,
            keep_every: p.keep_every,
            min_age: p.min_age.map(|d| humantime::format_duration(d).to_string()),
            max_bytes: p.max_bytes.map(|b| b.to_string()),
            dry_run: p.dry_run,
        }
    }
}

/// One published version as the policy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    /// Catalog row id.
    pub id: i64,
    /// Job name.
    pub job: String,
    /// Source site.
    pub source_site: String,
    /// Training step, if the source sent one.
    pub step: Option<u64>,
    /// Publish time, Unix ms.
    pub published_ms: i64,
    /// Its files as (identity, bytes): a file two versions share (a hard
    /// link) has the same identity in both and counts once toward
    /// `max_bytes`.
    pub files: Vec<((u64, u64), u64)>,
    /// Pinned (by an operator): never expires.
    pub pinned: bool,
    /// Held by a live reader lease: never expires while it is.
    pub leased: bool,
}

/// Why a version is kept (the first that applies, in this order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kept {
    /// Pinned.
    Pinned,
    /// Younger than `min_age`.
    MinAge,
    /// Its step is a multiple of `keep_every`.
    KeepEvery,
    /// Among the newest `keep_last` (or `keep_last` is unset).
    KeepLast,
    /// Held by a reader lease, and by no other rule.
    Leased,
}

/// Why a version expires.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expired {
    /// No rule keeps it.
    NotKept,
    /// Kept only by `keep_last` or `keep_every`, and the oldest of its
    /// group while the group held more than `max_bytes`; the group's bytes
    /// before it went.
    MaxBytes(u64),
}

/// The verdict for one version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Catalog row id.
    pub id: i64,
    /// Index of the policy that decided, in config order.
    pub policy: usize,
    /// `Ok(why kept)` or `Err(why it expires)`.
    pub outcome: Result<Kept, Expired>,
}

/// Applies `policies` (first match per job wins) to `versions` at time
/// `now_ms` (Unix ms). Returns one verdict per version a policy applies
/// to, in the order of `versions`; a version of a job no policy matches
/// has none (it is kept).
pub fn evaluate(policies: &[RetentionPolicy], versions: &[Version], now_ms: i64) -> Vec<Verdict> {
    // Group by (policy, job, source site), keeping input positions.
    let mut groups: BTreeMap<(usize, &str, &str), Vec<usize>> = BTreeMap::new();
    for (i, v) in versions.iter().enumerate() {
        if let Some(p) = policies.iter().position(|p| p.matches(&v.job)) {
            groups
                .entry((p, v.job.as_str(), v.source_site.as_str()))
                .or_default()
                .push(i);
        }
    }
    let mut out: Vec<Option<Verdict>> = vec![None; versions.len()];
    for ((pi, _, _), mut members) in groups {
        let p = &policies[pi];
        // Newest first.
        let by_step = members.iter().all(|&i| versions[i].step.is_some());
        members.sort_by(|&a, &b| {
            let (va, vb) = (&versions[a], &versions[b]);
            let key = |v: &Version| {
                (
                    if by_step { v.step.unwrap_or(0) } else { 0 },
                    v.published_ms,
                    v.id,
                )
            };
            key(vb).cmp(&key(va))
        });
        let mut outcome: Vec<Result<Kept, Expired>> = members
            .iter()
            .enumerate()
            .map(|(rank, &i)| {
                let v = &versions[i];
                let age_ms = now_ms.saturating_sub(v.published_ms);
                if v.pinned {
                    Ok(Kept::Pinned)
                } else if p
                    .min_age
                    .is_some_and(|m| i128::from(age_ms) < m.as_millis() as i128)
                {
                    Ok(Kept::MinAge)
                } else if p
                    .keep_every
                    .is_some_and(|n| v.step.is_some_and(|s| s % n == 0))
                {
                    Ok(Kept::KeepEvery)
                } else if p.keep_last.is_none_or(|n| rank < n as usize) {
                    Ok(Kept::KeepLast)
                } else if v.leased {
                    Ok(Kept::Leased)
                } else {
                    Err(Expired::NotKept)
                }
            })
            .collect();
        if let Some(max) = p.max_bytes {
            let bytes_of = |outcome: &[Result<Kept, Expired>]| {
                let mut seen = HashSet::new();
                let mut total = 0u64;
                for (k, &i) in members.iter().enumerate() {
                    if outcome[k].is_ok() {
                        for (id, b) in &versions[i].files {
                            if seen.insert(*id) {
                                total = total.saturating_add(*b);
                            }
                        }
                    }
                }
                total
            };
            // Oldest first; the newest (rank 0) stays.
            for k in (1..members.len()).rev() {
                let total = bytes_of(&outcome);
                if total <= max {
                    break;
                }
                if matches!(outcome[k], Ok(Kept::KeepLast | Kept::KeepEvery))
                    && !versions[members[k]].leased
                {
                    outcome[k] = Err(Expired::MaxBytes(total));
                }
            }
        }
        for (k, i) in members.into_iter().enumerate() {
            out[i] = Some(Verdict {
                id: versions[i].id,
                policy: pi,
                outcome: outcome[k].clone(),
            });
        }
    }
    out.into_iter().flatten().collect()
}

/// The version a signal's pin request names among `versions` (one job
/// of one source site, current versions only): the newest for
/// [`PinTarget::Newest`]; the newest version of that step for
/// [`PinTarget::Step`]; for [`PinTarget::AtOrAfter`], of the versions
/// whose step is at or above it, one of the smallest step. `None` when
/// there is none (yet).
pub fn pin_target(versions: &[Version], target: PinTarget) -> Option<i64> {
    let newest_key = |v: &&Version| (v.published_ms, v.id);
    match target {
        PinTarget::Newest => {
            let by_step = versions.iter().all(|v| v.step.is_some());
            versions
                .iter()
                .max_by_key(|v| {
                    (
                        if by_step { v.step.unwrap_or(0) } else { 0 },
                        v.published_ms,
                        v.id,
                    )
                })
                .map(|v| v.id)
        }
        PinTarget::Step(s) => versions
            .iter()
            .filter(|v| v.step == Some(s))
            .max_by_key(newest_key)
            .map(|v| v.id),
        PinTarget::AtOrAfter(s) => {
            let first = versions
                .iter()
                .filter_map(|v| v.step)
                .filter(|&x| x >= s)
                .min()?;
            versions
                .iter()
                .filter(|v| v.step == Some(first))
                .max_by_key(newest_key)
                .map(|v| v.id)
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const MIN: i64 = 60_000;
    const NOW: i64 = 1_800_000_000_000;

    fn policy(
        keep_last: Option<u32>,
        keep_every: Option<u64>,
        min_age: Option<Duration>,
        max_bytes: Option<u64>,
    ) -> RetentionPolicy {
        RetentionPolicy::new("*", keep_last, keep_every, min_age, max_bytes, false).unwrap()
    }

    #[test]
    fn a_policy_without_keep_last_or_max_bytes_keeps_everything() {
        let hour = Some(Duration::from_secs(3600));
        assert!(policy(None, Some(100), None, None).keeps_everything());
        assert!(policy(None, None, hour, None).keeps_everything());
        assert!(!policy(Some(2), Some(100), None, None).keeps_everything());
        assert!(!policy(None, None, hour, Some(10)).keeps_everything());
        // And indeed nothing expires under it.
        let vs: Vec<Version> = (1..=5)
            .map(|i| v(i, Some(i as u64 * 100), 600, 10))
            .collect();
        let p = policy(None, Some(1000), hour, None);
        assert!(evaluate(&[p], &vs, NOW).iter().all(|x| x.outcome.is_ok()));
    }

    /// Version `id` of job `j` at site `a`, at `step`, published `age`
    /// minutes before NOW, one file of `bytes` of its own.
    fn v(id: i64, step: Option<u64>, age_min: i64, bytes: u64) -> Version {
        Version {
            id,
            job: "j".into(),
            source_site: "a".into(),
            step,
            published_ms: NOW - age_min * MIN,
            files: vec![((id as u64, 1), bytes)],
            pinned: false,
            leased: false,
        }
    }

    /// Ids kept, in input order.
    fn kept(p: &[RetentionPolicy], vs: &[Version]) -> Vec<i64> {
        evaluate(p, vs, NOW)
            .into_iter()
            .filter(|v| v.outcome.is_ok())
            .map(|v| v.id)
            .collect()
    }

    /// Ten versions at steps 100..=1000, step 1000 the newest (published
    /// 1 minute ago), step 100 the oldest (10 minutes ago), 10 bytes each.
    fn ten() -> Vec<Version> {
        (1..=10)
            .map(|i| v(i, Some(i as u64 * 100), 11 - i, 10))
            .collect()
    }

    #[test]
    fn keep_last_alone_keeps_the_newest_by_step() {
        let p = [policy(Some(3), None, None, None)];
        assert_eq!(kept(&p, &ten()), vec![8, 9, 10]);
        // By step, not by publish time: an older step published last.
        let mut vs = ten();
        vs[0].published_ms = NOW;
        assert_eq!(kept(&p, &vs), vec![8, 9, 10]);
        let verdicts = evaluate(&p, &vs, NOW);
        assert_eq!(verdicts[0].outcome, Err(Expired::NotKept));
        assert_eq!(verdicts[9].outcome, Ok(Kept::KeepLast));
    }

    #[test]
    fn without_steps_keep_last_orders_by_publish_time() {
        let p = [policy(Some(2), None, None, None)];
        let vs = vec![v(1, None, 5, 1), v(2, None, 1, 1), v(3, Some(900), 9, 1)];
        // One version without a step: the group orders by publish time.
        assert_eq!(kept(&p, &vs), vec![1, 2]);
    }

    #[test]
    fn keep_every_alone_keeps_everything_as_keep_last_is_unlimited() {
        let p = [policy(None, Some(300), None, None)];
        assert_eq!(kept(&p, &ten()).len(), 10);
        let verdicts = evaluate(&p, &ten(), NOW);
        assert_eq!(verdicts[2].outcome, Ok(Kept::KeepEvery));
        assert_eq!(verdicts[0].outcome, Ok(Kept::KeepLast));
    }

    #[test]
    fn min_age_alone_keeps_everything_as_keep_last_is_unlimited() {
        let p = [policy(None, None, Some(Duration::from_secs(150)), None)];
        let verdicts = evaluate(&p, &ten(), NOW);
        assert!(verdicts.iter().all(|v| v.outcome.is_ok()));
        // Published 1 and 2 minutes ago: younger than 2.5 minutes.
        assert_eq!(verdicts[9].outcome, Ok(Kept::MinAge));
        assert_eq!(verdicts[8].outcome, Ok(Kept::MinAge));
        assert_eq!(verdicts[7].outcome, Ok(Kept::KeepLast));
    }

    #[test]
    fn max_bytes_alone_expires_the_oldest_until_under() {
        let p = [policy(None, None, None, Some(35))];
        assert_eq!(kept(&p, &ten()), vec![8, 9, 10]);
        let verdicts = evaluate(&p, &ten(), NOW);
        assert_eq!(verdicts[0].outcome, Err(Expired::MaxBytes(100)));
        assert_eq!(verdicts[6].outcome, Err(Expired::MaxBytes(40)));
        // Exactly at the limit is under it.
        let p = [policy(None, None, None, Some(30))];
        assert_eq!(kept(&p, &ten()), vec![8, 9, 10]);
    }

    #[test]
    fn max_bytes_below_one_version_keeps_the_newest() {
        let p = [policy(None, None, None, Some(1))];
        assert_eq!(kept(&p, &ten()), vec![10]);
        assert!(RetentionPolicy::new("*", Some(0), None, None, None, false)
            .unwrap_err()
            .contains("keep_last"));
    }

    #[test]
    fn max_bytes_counts_a_shared_file_once() {
        let p = [policy(None, None, None, Some(25))];
        let mut vs: Vec<Version> = (1..=3).map(|i| v(i, Some(i as u64), 4 - i, 10)).collect();
        // All three share one 10-byte file (hard links) beside their own
        // 5 bytes: 10 + 3 x 5 = 25 bytes, under the limit.
        for x in &mut vs {
            x.files = vec![((99, 1), 10), ((x.id as u64, 2), 5)];
        }
        assert_eq!(kept(&p, &vs), vec![1, 2, 3]);
        // Counted per version it would be 45 and two would go.
        let p = [policy(None, None, None, Some(24))];
        assert_eq!(kept(&p, &vs), vec![2, 3]);
    }

    #[test]
    fn keep_last_with_keep_every() {
        let p = [policy(Some(2), Some(400), None, None)];
        assert_eq!(kept(&p, &ten()), vec![4, 8, 9, 10]);
        let verdicts = evaluate(&p, &ten(), NOW);
        assert_eq!(verdicts[3].outcome, Ok(Kept::KeepEvery));
    }

    #[test]
    fn keep_last_with_min_age() {
        let p = [policy(
            Some(1),
            None,
            Some(Duration::from_secs(3 * 60 + 30)),
            None,
        )];
        // Published 1, 2 and 3 minutes ago are young; the newest also by
        // keep_last.
        assert_eq!(kept(&p, &ten()), vec![8, 9, 10]);
    }

    #[test]
    fn min_age_and_pins_protect_from_max_bytes_but_keep_every_does_not() {
        let mut vs = ten();
        vs[0].pinned = true; // step 100, the oldest
        let p = [policy(
            Some(5),
            Some(200),
            Some(Duration::from_secs(90)),
            Some(40),
        )];
        // Kept before max_bytes: 1 pinned; 10 by min_age; 2, 4, 6, 8 by
        // keep_every; 7 and 9 by keep_last (80 bytes). Oldest first, 2,
        // 4, 6 and 7 go until 40 bytes remain; the pin stays.
        let verdicts = evaluate(&p, &vs, NOW);
        let k: Vec<i64> = verdicts
            .iter()
            .filter(|v| v.outcome.is_ok())
            .map(|v| v.id)
            .collect();
        assert_eq!(k, vec![1, 8, 9, 10]);
        assert_eq!(verdicts[0].outcome, Ok(Kept::Pinned));
        assert_eq!(verdicts[9].outcome, Ok(Kept::MinAge));
        assert_eq!(verdicts[1].outcome, Err(Expired::MaxBytes(80)));
        assert_eq!(verdicts[2].outcome, Err(Expired::NotKept));
    }

    #[test]
    fn all_four_keys_with_everything_protected_keep_all_over_max_bytes() {
        let mut vs = ten();
        for x in &mut vs {
            x.pinned = true;
        }
        let p = [policy(
            Some(1),
            Some(7),
            Some(Duration::from_secs(1)),
            Some(1),
        )];
        assert_eq!(kept(&p, &vs).len(), 10);
    }

    #[test]
    fn a_leased_version_outlives_keep_last_and_max_bytes_without_taking_a_place() {
        // Ten versions, steps 100..1000, 10 bytes each; version 3 leased.
        let mut vs = ten();
        vs[2].leased = true;
        let p = [policy(Some(2), None, None, None)];
        assert_eq!(kept(&p, &vs), vec![3, 9, 10]);
        let verdicts = evaluate(&p, &vs, NOW);
        assert_eq!(verdicts[2].outcome, Ok(Kept::Leased));
        // The newest two are still the newest two: the lease took no
        // place among them.
        assert_eq!(verdicts[9].outcome, Ok(Kept::KeepLast));
        assert_eq!(verdicts[8].outcome, Ok(Kept::KeepLast));
        // A leased version among the newest is not expired by max_bytes
        // either: 10 and 9 are leased, keep_last 3 keeps 8 too, 15 bytes
        // allowed: only 8 goes.
        let mut vs = ten();
        vs[8].leased = true;
        vs[9].leased = true;
        let p = [policy(Some(3), None, None, Some(15))];
        let verdicts = evaluate(&p, &vs, NOW);
        assert_eq!(verdicts[7].outcome, Err(Expired::MaxBytes(30)));
        assert_eq!(kept(&p, &vs), vec![9, 10]);
        // When the lease ends, the policy alone decides.
        vs[8].leased = false;
        assert_eq!(kept(&p, &vs), vec![10]);
    }

    #[test]
    fn a_pin_request_names_the_version_around_a_step() {
        // Steps 100..1000 (ids 1..10); step 300 saved twice (ids 3, 11).
        let mut vs = ten();
        vs.push(v(11, Some(300), 0, 10));
        assert_eq!(pin_target(&vs, PinTarget::Newest), Some(10));
        assert_eq!(pin_target(&vs, PinTarget::Step(300)), Some(11));
        assert_eq!(pin_target(&vs, PinTarget::Step(350)), None);
        assert_eq!(pin_target(&vs, PinTarget::AtOrAfter(250)), Some(11));
        assert_eq!(pin_target(&vs, PinTarget::AtOrAfter(1000)), Some(10));
        assert_eq!(pin_target(&vs, PinTarget::AtOrAfter(1001)), None);
        assert_eq!(pin_target(&[], PinTarget::Newest), None);
        // Without steps, the newest is the last published.
        let vs = vec![v(1, None, 5, 1), v(2, None, 1, 1), v(3, None, 3, 1)];
        assert_eq!(pin_target(&vs, PinTarget::Newest), Some(2));
    }

    #[test]
    fn a_signal_pin_keeps_a_version_until_it_ends_then_the_policy_decides() {
        // Version 3 (step 300) pinned until NOW + 1 min: kept by the pin
        // now, expired by keep_last 1 once the clock passes its end.
        let until = NOW + MIN;
        // As the sink weighs a pin at `now`: live while `until` is ahead.
        let kept_at = |now: i64| {
            let mut vs = ten();
            vs[2].pinned = until > now;
            kept(&[policy(Some(1), None, None, None)], &vs)
        };
        assert_eq!(kept_at(NOW), vec![3, 10]);
        assert_eq!(kept_at(until + 1), vec![10]);
    }

    #[test]
    fn a_pinned_version_never_expires() {
        let mut vs = ten();
        vs[0].pinned = true;
        let p = [policy(Some(1), None, None, None)];
        assert_eq!(kept(&p, &vs), vec![1, 10]);
    }

    #[test]
    fn groups_are_per_job_and_source_site_and_the_first_matching_policy_wins() {
        let mut vs = ten();
        for x in &mut vs[..5] {
            x.source_site = "b".into();
        }
        vs.push(Version {
            job: "other".into(),
            ..v(11, Some(1), 100, 1)
        });
        let p = [
            RetentionPolicy::new("j", Some(1), None, None, None, false).unwrap(),
            RetentionPolicy::new("*", Some(3), None, None, None, false).unwrap(),
        ];
        // j at site b keeps step 500, at site a step 1000; "other" falls
        // to the second policy and is the only one of its group.
        assert_eq!(kept(&p, &vs), vec![5, 10, 11]);
        let verdicts = evaluate(&p, &vs, NOW);
        assert_eq!(verdicts.last().unwrap().policy, 1);
        // A job no policy matches gets no verdict: it is kept.
        let only_j = [RetentionPolicy::new("j", Some(1), None, None, None, false).unwrap()];
        assert!(evaluate(&only_j, &vs, NOW).iter().all(|v| v.id != 11));
    }

    #[test]
    fn a_policy_of_none_of_the_four_keys_or_a_bad_glob_is_refused_naming_it() {
        let e = RetentionPolicy::new("llama", None, None, None, None, true).unwrap_err();
        assert!(
            e.contains("none of keep_last, keep_every, min_age, max_bytes"),
            "{e}"
        );
        assert!(e.contains("llama"), "{e}");
        let e = RetentionPolicy::new("[", Some(1), None, None, None, false).unwrap_err();
        assert!(e.contains("job glob"), "{e}");
        let e = RetentionPolicy::new("*", None, Some(0), None, None, false).unwrap_err();
        assert!(e.contains("keep_every"), "{e}");
    }

    #[test]
    fn an_empty_catalog_and_a_future_publish_time_are_harmless() {
        let p = [policy(Some(1), None, Some(Duration::from_secs(60)), None)];
        assert!(evaluate(&p, &[], NOW).is_empty());
        // Published "in the future" (clocks): young, kept.
        let vs = vec![v(1, Some(1), -5, 1), v(2, Some(2), 10, 1)];
        assert_eq!(kept(&p, &vs), vec![1, 2]);
    }
}
