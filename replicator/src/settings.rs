//! The pool's shared settings as a source agent uses them
//! (ARCHITECTURE.md, "Pool"): the scheduler's policy and each link's
//! rate cap, stored in the catalog's `settings` table
//! ([`ferry_catalog::settings`]) under the names of the config file's
//! keys: `scheduler.max_active`, `scheduler.weights.severity`, ...,
//! and `link.NAME.rate` (bit/s).
//!
//! On PostgreSQL (a pool) the catalog's values win: at start an agent
//! writes its config's values only where the catalog has none
//! ([`adopt`]), logs a warning naming each setting whose config value
//! differs (with both values) and uses the catalog's. While it runs it
//! reads the settings and the recent signals again about every second
//! and at once when another agent announces a change on the catalog's
//! notification channel ([`follow`]), so a change made through any
//! agent's API reaches every agent of the pool. A single agent on SQLite
//! keeps its config's values (none of this runs).

use std::time::Duration;

use ferry_catalog::{Catalog, CatalogError, Setting};
use scheduler::{Policy, PolicyKind};
use serde_json::{json, Value};
use tracing::{info, warn};

/// The scheduler's settings, by the name of their config key
/// (`[scheduler]`), as stored in a pool's catalog.
pub const SCHEDULER_SETTINGS: [&str; 14] = [
    "scheduler.policy",
    "scheduler.aging",
    "scheduler.aging_cap",
    "scheduler.severity_half_life",
    "scheduler.urgent_for",
    "scheduler.max_active",
    "scheduler.small_transfer",
    "scheduler.max_small_active",
    "scheduler.weights.model_size",
    "scheduler.weights.importance",
    "scheduler.weights.severity",
    "scheduler.floors.scheduled",
    "scheduler.floors.background",
    "scheduler.deadline_first",
];

/// How often an agent of a pool reads the shared settings and recent
/// signals again without a notification (1 s).
pub const REFRESH: Duration = Duration::from_secs(1);

/// The setting name of `link`'s rate cap: `link.NAME.rate`.
pub fn link_rate_setting(link: &str) -> String {
    format!("link.{link}.rate")
}

/// The link of a `link.NAME.rate` setting name.
pub fn link_of_setting(name: &str) -> Option<&str> {
    name.strip_prefix("link.")?.strip_suffix(".rate")
}

fn duration_value(ms: u64) -> Value {
    json!(humantime::format_duration(Duration::from_millis(ms)).to_string())
}

/// `p` as settings, `(name, value)` in the order of
/// [`SCHEDULER_SETTINGS`]: durations as strings (`"10m"`), the size of a
/// small transfer in bytes.
pub fn policy_settings(p: &Policy) -> Vec<(String, Value)> {
    let values = [
        json!(p.kind.as_str()),
        duration_value(p.aging_ms),
        json!(p.aging_cap),
        duration_value(p.severity_half_life_ms),
        duration_value(p.urgent_for_ms),
        json!(p.max_active),
        json!(p.small_bytes),
        json!(p.max_small_active),
        json!(p.weights.size),
        json!(p.weights.importance),
        json!(p.weights.severity),
        json!(p.floors.scheduled),
        json!(p.floors.background),
        json!(p.deadline_first),
    ];
    SCHEDULER_SETTINGS
        .iter()
        .zip(values)
        .map(|(n, v)| (n.to_string(), v))
        .collect()
}

/// `v` as text: a string as it is, anything else as JSON.
fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        o => o.to_string(),
    }
}

fn number(name: &str, v: &Value) -> Result<f64, String> {
    let n = match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse::<f64>().ok(),
        _ => None,
    };
    n.filter(|n| n.is_finite())
        .ok_or_else(|| format!("{name} must be a number, got {}", text(v)))
}

fn whole(name: &str, v: &Value) -> Result<u64, String> {
    let n = match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse::<u64>().ok(),
        _ => None,
    };
    n.ok_or_else(|| format!("{name} must be a whole number, got {}", text(v)))
}

/// The canonical stored value of setting `name` from `v`, a JSON value
/// or its text as typed (`"2Gbit/s"` or `"2Gbit"` for a rate, `"10m"`
/// for a duration, `"16MiB"` for a size, `"8"` for a number).
///
/// # Errors
/// A message naming the setting: an unknown name, or a value of the
/// wrong kind. Ranges are checked by [`apply_policy_setting`] and by
/// the link's rate bounds.
pub fn parse_value(name: &str, v: &Value) -> Result<Value, String> {
    if link_of_setting(name).is_some() {
        let bps = match v {
            Value::String(s) => {
                let s = s.trim();
                let full = if s.ends_with("bit") {
                    format!("{s}/s")
                } else {
                    s.to_string()
                };
                ferry_proto::units::parse_rate(&full).map_err(|e| format!("{name}: {e}"))?
            }
            o => whole(name, o)?,
        };
        return Ok(json!(bps));
    }
    let key = name.strip_prefix("scheduler.").unwrap_or("");
    match key {
        "policy" => match text(v).trim() {
            p @ ("priority" | "fifo") => Ok(json!(p)),
            o => Err(format!(
                "{name} must be \"priority\" or \"fifo\", got {o:?}"
            )),
        },
        "aging" | "severity_half_life" | "urgent_for" => {
            let d = humantime::parse_duration(text(v).trim())
                .map_err(|e| format!("{name} must be a duration such as \"10m\": {e}"))?;
            Ok(duration_value(d.as_millis().min(u64::MAX as u128) as u64))
        }
        "small_transfer" => match v {
            Value::String(s) if s.trim().parse::<u64>().is_err() => {
                let b =
                    ferry_proto::units::parse_size(s.trim()).map_err(|e| format!("{name}: {e}"))?;
                Ok(json!(b))
            }
            o => Ok(json!(whole(name, o)?)),
        },
        "max_active" | "max_small_active" => Ok(json!(whole(name, v)?)),
        "deadline_first" => match v {
            Value::Bool(b) => Ok(json!(b)),
            Value::String(s) if matches!(s.trim(), "true" | "false") => {
                Ok(json!(s.trim() == "true"))
            }
            o => Err(format!("{name} must be true or false, got {o}")),
        },
        "aging_cap" | "weights.model_size" | "weights.importance" | "weights.severity"
        | "floors.scheduled" | "floors.background" => Ok(json!(number(name, v)?)),
        _ => Err(format!(
            "unknown setting {name:?}: a pool shares {}, link.NAME.rate, job.NAME.importance \
             and job.NAME.model_params",
            SCHEDULER_SETTINGS.join(", ")
        )),
    }
}

/// Sets scheduler setting `name` of `p` to `v` (any form
/// [`parse_value`] reads) and checks the whole policy
/// ([`Policy::check`]).
///
/// # Errors
/// A message naming the setting; `p` is left as it was.
pub fn apply_policy_setting(p: &mut Policy, name: &str, v: &Value) -> Result<(), String> {
    let mut n = p.clone();
    set_policy_field(&mut n, name, v)?;
    n.check().map_err(|e| format!("scheduler.{e}"))?;
    *p = n;
    Ok(())
}

/// Sets scheduler setting `name` of `n` to `v` without checking the
/// policy as a whole (settings that are only valid together, such as
/// the two floors, are set one by one, then checked once).
///
/// # Errors
/// A message naming the setting when `v` is not a value of it.
fn set_policy_field(n: &mut Policy, name: &str, v: &Value) -> Result<(), String> {
    let v = parse_value(name, v)?;
    let ms = |v: &Value| -> Result<u64, String> {
        let d = humantime::parse_duration(&text(v)).map_err(|e| format!("{name}: {e}"))?;
        Ok(d.as_millis().min(u64::MAX as u128) as u64)
    };
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let u = |v: &Value| v.as_u64().unwrap_or(u64::MAX);
    match name.strip_prefix("scheduler.").unwrap_or("") {
        "policy" => {
            n.kind = if v == json!("fifo") {
                PolicyKind::Fifo
            } else {
                PolicyKind::Priority
            }
        }
        "aging" => n.aging_ms = ms(&v)?,
        "severity_half_life" => n.severity_half_life_ms = ms(&v)?,
        "urgent_for" => n.urgent_for_ms = ms(&v)?,
        "aging_cap" => n.aging_cap = f(&v),
        "max_active" => n.max_active = usize::try_from(u(&v)).unwrap_or(usize::MAX),
        "small_transfer" => n.small_bytes = u(&v),
        "max_small_active" => n.max_small_active = usize::try_from(u(&v)).unwrap_or(usize::MAX),
        "weights.model_size" => n.weights.size = f(&v),
        "weights.importance" => n.weights.importance = f(&v),
        "weights.severity" => n.weights.severity = f(&v),
        "floors.scheduled" => n.floors.scheduled = f(&v),
        "floors.background" => n.floors.background = f(&v),
        "deadline_first" => n.deadline_first = v.as_bool().unwrap_or(true),
        _ => return Err(format!("{name} is not a scheduler setting")),
    }
    Ok(())
}

/// The policy of a pool: `base` (the agent's config) with every stored
/// scheduler setting of `stored` applied, and what could not be used.
/// The values are first applied all together and the policy checked
/// once (settings valid only together, such as the two floors, are
/// taken as a whole). If that fails (a value this agent cannot read,
/// written by another release, or values written outside
/// [`Catalog::put_setting_checked`]), they are applied one by one in
/// name order, each checked, and those that cannot be used stay at
/// `base`'s and are named (setting, value and why).
pub fn policy_from(base: &Policy, stored: &[Setting]) -> (Policy, Vec<String>) {
    let scheduler = || {
        stored
            .iter()
            .filter(|s| SCHEDULER_SETTINGS.contains(&s.name.as_str()))
    };
    let mut all = base.clone();
    if scheduler().all(|s| set_policy_field(&mut all, &s.name, &s.value).is_ok())
        && all.check().is_ok()
    {
        return (all, Vec::new());
    }
    let mut p = base.clone();
    let mut unusable = Vec::new();
    for s in scheduler() {
        if let Err(e) = apply_policy_setting(&mut p, &s.name, &s.value) {
            unusable.push(format!("{} = {}: {e}", s.name, s.value));
        }
    }
    (p, unusable)
}

/// Checks that `stored` (every setting of a pool, one of them about to
/// change) makes a valid policy on top of `base`: for
/// [`Catalog::put_setting_checked`].
///
/// # Errors
/// The first setting that is not a value of its kind, or why the policy
/// as a whole is invalid.
pub fn check_stored_policy(base: &Policy, stored: &[Setting]) -> Result<(), String> {
    let mut p = base.clone();
    for s in stored
        .iter()
        .filter(|s| SCHEDULER_SETTINGS.contains(&s.name.as_str()))
    {
        set_policy_field(&mut p, &s.name, &s.value)?;
    }
    p.check().map_err(|e| {
        // A value invalid on its own is named as such; the pool's other
        // settings are mentioned only when the combination is at fault.
        for s in stored
            .iter()
            .filter(|s| SCHEDULER_SETTINGS.contains(&s.name.as_str()))
        {
            let mut alone = base.clone();
            if set_policy_field(&mut alone, &s.name, &s.value).is_ok() {
                if let Err(e) = alone.check() {
                    return format!("scheduler.{e}");
                }
            }
        }
        format!("scheduler.{e} (with the pool's other scheduler settings as stored now)")
    })
}

/// A shared setting's stored value as a user writes it: a rate as
/// `"2Gbit/s"`, `scheduler.small_transfer` as `"16MiB"` (whole KiB or
/// MiB, else bytes), text as it is, other values as JSON.
pub fn display_value(name: &str, v: &Value) -> String {
    match v {
        Value::Number(n) if name.ends_with(".rate") => {
            ferry_proto::units::format_rate(n.as_u64().unwrap_or(0))
        }
        Value::Number(n) if name == "scheduler.small_transfer" => match n.as_u64() {
            Some(b) if b > 0 && b % (1 << 20) == 0 => format!("{}MiB", b >> 20),
            Some(b) if b > 0 && b % (1 << 10) == 0 => format!("{}KiB", b >> 10),
            Some(b) => format!("{b}B"),
            None => v.to_string(),
        },
        Value::String(t) => t.clone(),
        Value::Null => "unknown".into(),
        v => v.to_string(),
    }
}

/// A setting whose value in an agent's config differs from the pool's.
#[derive(Debug, Clone, PartialEq)]
pub struct Difference {
    /// The setting (`scheduler.max_active`, `link.NAME.rate`,
    /// `job.NAME.importance`, ...).
    pub setting: String,
    /// The config's value.
    pub config: Value,
    /// The catalog's value, which the agent uses.
    pub catalog: Value,
    /// Whether the catalog's value came from another agent's config
    /// (two files disagree), rather than a change through the API.
    pub from_config: bool,
}

/// Seeds a pool's catalog from an agent's config and adopts the
/// catalog's values: the scheduler's `policy`, the rate caps of `links`
/// (`(name, bit/s)`, changed in place) and `jobs` (`(name,
/// model_params, importance)`) are written where the catalog has none
/// (the first agent to start wins; `agent` is recorded as their writer);
/// each config value that differs from the catalog's is logged as a
/// warning naming the setting and both values. Returns the policy to
/// run with and the differences.
///
/// # Errors
/// Catalog errors, and values the catalog refuses (naming them).
pub async fn adopt(
    catalog: &Catalog,
    agent: &str,
    policy: &Policy,
    links: &mut [(String, u64)],
    jobs: &[(String, Option<f64>, f64)],
) -> Result<(Policy, Vec<Difference>), CatalogError> {
    let by = format!("config of {agent}");
    let mut seed = policy_settings(policy);
    for (l, bps) in links.iter() {
        seed.push((link_rate_setting(l), json!(bps)));
    }
    let stored = catalog.seed_settings(&seed, &by).await?;
    let mut diffs = Vec::new();
    for (name, mine) in &seed {
        let Some(s) = stored.iter().find(|s| &s.name == name) else {
            continue;
        };
        let theirs = parse_value(name, &s.value).unwrap_or(s.value.clone());
        if &theirs != mine {
            diffs.push(Difference {
                setting: name.clone(),
                config: mine.clone(),
                catalog: theirs,
                from_config: s.updated_by.starts_with("config of "),
            });
        }
    }
    let (policy, unusable) = policy_from(policy, &stored);
    for e in &unusable {
        warn!("the pool's catalog holds a value this agent cannot use; keeping its config's: {e}");
    }
    for (l, bps) in links.iter_mut() {
        let name = link_rate_setting(l);
        if let Some(v) = stored
            .iter()
            .find(|s| s.name == name)
            .and_then(|s| s.value.as_u64())
            .filter(|v| *v > 0)
        {
            *bps = v;
        }
    }
    let held = catalog.seed_config_jobs(jobs).await?;
    for (name, params, importance) in jobs {
        let Some(j) = held.iter().find(|j| &j.name == name) else {
            continue;
        };
        if j.importance != *importance {
            diffs.push(Difference {
                setting: format!("job.{name}.importance"),
                config: json!(importance),
                catalog: json!(j.importance),
                from_config: j.origin == ferry_catalog::origin::CONFIG,
            });
        }
        let params = params.filter(|p| *p > 0.0);
        if j.model_params != params {
            diffs.push(Difference {
                setting: format!("job.{name}.model_params"),
                config: json!(params.unwrap_or(0.0)),
                catalog: json!(j.model_params.unwrap_or(0.0)),
                from_config: j.origin == ferry_catalog::origin::CONFIG,
            });
        }
    }
    for d in &diffs {
        if d.from_config {
            // Two agents' files disagree: one of them is not what the
            // operator meant.
            warn!(
                setting = d.setting,
                config = %display_value(&d.setting, &d.config),
                catalog = %display_value(&d.setting, &d.catalog),
                "this agent's config differs from the pool's catalog; using the catalog's value \
                 (change it with `ferry pool set`)"
            );
        } else {
            // Changed through the API since the files were written: the
            // expected state of a running pool.
            info!(
                setting = d.setting,
                config = %display_value(&d.setting, &d.config),
                catalog = %display_value(&d.setting, &d.catalog),
                "this agent's config differs from the pool's catalog, where the value was set \
                 through the API; using the catalog's value"
            );
        }
    }
    Ok((policy, diffs))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn policy_round_trips_through_its_settings() {
        let mut p = Policy {
            kind: PolicyKind::Fifo,
            max_active: 9,
            aging_ms: 90_000,
            ..Policy::default()
        };
        p.weights.severity = 3.5;
        let mut q = Policy::default();
        for (n, v) in policy_settings(&p) {
            apply_policy_setting(&mut q, &n, &v).unwrap();
        }
        assert_eq!(q, p);
    }

    #[test]
    fn typed_values_are_read_and_bad_ones_named() {
        assert_eq!(
            parse_value("link.to-eval.rate", &json!("2Gbit")).unwrap(),
            json!(2_000_000_000u64)
        );
        assert_eq!(
            parse_value("link.x.rate", &json!("250Mbit/s")).unwrap(),
            json!(250_000_000u64)
        );
        assert_eq!(
            parse_value("scheduler.max_active", &json!("8")).unwrap(),
            json!(8)
        );
        assert_eq!(
            parse_value("scheduler.aging", &json!("600s")).unwrap(),
            json!("10m")
        );
        assert_eq!(
            parse_value("scheduler.small_transfer", &json!("1MiB")).unwrap(),
            json!(1u64 << 20)
        );
        let e = parse_value("scheduler.nope", &json!(1)).unwrap_err();
        assert!(e.contains("unknown setting \"scheduler.nope\""), "{e}");
        let e = parse_value("scheduler.max_active", &json!("many")).unwrap_err();
        assert!(e.starts_with("scheduler.max_active"), "{e}");
        let mut p = Policy::default();
        let e = apply_policy_setting(&mut p, "scheduler.max_active", &json!(0)).unwrap_err();
        assert!(
            e.starts_with("scheduler.max_active must be from 1 to 64"),
            "{e}"
        );
        assert_eq!(p, Policy::default());
    }

    #[test]
    fn settings_valid_only_together_are_applied_together() {
        let row = |name: &str, value: Value| Setting {
            name: name.into(),
            value,
            updated_at: 0,
            updated_by: "x".into(),
        };
        // Floors 0.4 + 0.5 are valid; background alone on top of a
        // scheduled floor of 0.6 (this agent's config) would not be.
        let base = Policy {
            floors: scheduler::Floors {
                scheduled: 0.6,
                ..Policy::default().floors
            },
            ..Policy::default()
        };
        let stored = [
            row("scheduler.floors.background", json!(0.5)),
            row("scheduler.floors.scheduled", json!(0.4)),
        ];
        let (p, unusable) = policy_from(&base, &stored);
        assert!(unusable.is_empty(), "{unusable:?}");
        assert_eq!((p.floors.scheduled, p.floors.background), (0.4, 0.5));
        // The checked write refuses a value invalid with the others.
        let e = check_stored_policy(
            &base,
            &[
                row("scheduler.floors.background", json!(0.5)),
                row("scheduler.floors.scheduled", json!(0.6)),
            ],
        )
        .unwrap_err();
        assert!(e.contains("floors"), "{e}");
        assert_eq!(check_stored_policy(&base, &stored), Ok(()));
    }

    #[test]
    fn stored_values_this_agent_cannot_use_keep_its_own_and_are_named() {
        let row = |name: &str, value: Value| Setting {
            name: name.into(),
            value,
            updated_at: 0,
            updated_by: "x".into(),
        };
        let stored = [
            row("scheduler.max_active", json!(9)),
            row("scheduler.aging_cap", json!(0.5)),
            row("scheduler.from_a_newer_release", json!(1)),
            row("link.l.rate", json!(5)),
        ];
        let (p, unusable) = policy_from(&Policy::default(), &stored);
        assert_eq!(p.max_active, 9);
        assert_eq!(p.aging_cap, Policy::default().aging_cap);
        assert_eq!(unusable.len(), 1, "{unusable:?}");
        assert!(
            unusable[0].starts_with("scheduler.aging_cap = 0.5: "),
            "{unusable:?}"
        );
    }
}
