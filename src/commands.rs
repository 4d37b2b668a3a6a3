//! Client commands of the agent API: `ferry status`, `ferry resolve`,
//! `ferry signal`, `ferry trace`, and `ferry token new` (which needs no
//! agent). Each renders the API's JSON for a person, or prints it raw with
//! `--json`; `ferry trace` writes the trace as the agent sends it.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use ferry_proto::state::{CheckpointState, TransferState};
use indicatif::HumanBytes;
use serde_json::{json, Value};

use crate::client::{Client, Exit, ServerArgs, REQUEST_TIMEOUT};
use crate::out::outln;

/// Exit code of `ferry resolve` when the path is not local (yet).
pub const NOT_LOCAL_EXIT: i32 = 3;

/// Items fetched per page of a list.
const PAGE: usize = 1000;

/// Most transfers or replicas `ferry status` reads (the newest).
const MAX_ITEMS: usize = 10_000;

// ----------------------------------------------------------- token new --

/// What `ferry token new` prints: the token alone on the first line, then
/// TOML (comments and the `[[api.tokens]]` entry) to paste into the
/// agent's config. Returns the token and the whole text.
///
/// # Errors
/// An empty name.
pub fn token_new(role: api::Role, name: Option<&str>) -> Result<(String, String)> {
    let token = api::auth::new_token();
    let hash = api::auth::hash_token(&token);
    let name = match name {
        Some(n) if n.trim().is_empty() => bail!("--name must not be empty"),
        Some(n) => n.trim().to_string(),
        // Unique enough to tell entries apart, and says nothing about the
        // token (it is part of its hash).
        None => format!("{role}-{}", &hash[api::auth::HASH_PREFIX.len()..][..8]),
    };
    let q = |s: &str| toml::Value::String(s.to_string()).to_string();
    let text = format!(
        "{token}\n\
         # The token above is shown only now: the agent's config holds only its hash.\n\
         # Give it to its user (FERRY_TOKEN or --token); add these lines to the agent's\n\
         # config file (after the [api] keys) and restart the agent:\n\
         [[api.tokens]]\n\
         name = {}\n\
         role = {}\n\
         hash = {}\n",
        q(&name),
        q(role.as_str()),
        q(&hash)
    );
    Ok((token, text))
}

// -------------------------------------------------------------- status --

/// Every item of a paginated list (`{"items", "limit", "offset"}`), newest
/// first, at most [`MAX_ITEMS`].
async fn all_items(c: &Client, path: &str) -> Result<Vec<Value>> {
    let mut items = Vec::new();
    loop {
        let (limit, offset) = (PAGE.to_string(), items.len().to_string());
        let page = c
            .get(path, &[("limit", &limit), ("offset", &offset)])
            .await?;
        let got = page["items"]
            .as_array()
            .with_context(|| format!("GET {path}: the answer has no items"))?;
        items.extend(got.iter().cloned());
        if got.len() < PAGE || items.len() >= MAX_ITEMS {
            return Ok(items);
        }
    }
}

/// `ferry status`: what the agent at `args.server` holds and moves.
///
/// # Errors
/// The agent cannot be reached or refuses (the message says why).
pub async fn status(args: &ServerArgs, raw: bool, slow: Option<u32>) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let health = c.get("/healthz", &[]).await?;
    let roles: Vec<&str> = health["roles"]
        .as_array()
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut out = json!({ "healthz": health });
    // A part the agent cannot give because its catalog does not answer
    // (503) is shown as missing, with the reason, and the rest is still
    // printed; the command then fails, naming the parts. Any other error
    // (no token, say) fails at once.
    let mut missing = Vec::new();
    let mut parts = Vec::new();
    if roles.contains(&"source") {
        parts.extend([("links", "/v1/links"), ("transfers", "/v1/transfers")]);
    }
    if roles.contains(&"sink") {
        parts.push(("replicas", "/v1/replicas"));
    }
    for (key, path) in parts {
        match all_items(&c, path).await {
            Ok(items) => out[key] = Value::Array(items),
            Err(e)
                if e.downcast_ref::<crate::client::HttpError>()
                    .is_some_and(|h| h.status == reqwest::StatusCode::SERVICE_UNAVAILABLE) =>
            {
                out["unavailable"][key] = Value::String(format!("{e:#}"));
                missing.push(key);
            }
            Err(e) => return Err(e),
        }
    }
    if raw {
        outln!("{}", serde_json::to_string_pretty(&out)?)?;
    } else if let Some(n) = slow {
        crate::out::print(format_args!("{}", render_slow(&out, n as usize, now_ms())))?;
    } else {
        crate::out::print(format_args!("{}", render_status(c.base(), &out, now_ms())))?;
    }
    if !missing.is_empty() {
        bail!(
            "the agent at {} could not give its {}",
            c.base(),
            missing.join(", ")
        );
    }
    Ok(())
}

/// How far back `ferry status --slow` looks, ms.
const SLOW_WINDOW_MS: i64 = 24 * 3600 * 1000;

/// `ferry status --slow`: the `n` slowest replicas published in the last
/// 24 hours before `now` (Unix ms), slowest first, each with its
/// commit-to-eval-ready time, the phase that took longest and every
/// phase after the commit. A sink's replicas (`replicas`), or a source's
/// published transfers (`transfers`, whose commit-to-ready time is the
/// source's: until the sink said it published).
fn render_slow(out: &Value, n: usize, now: i64) -> String {
    let mut rows: Vec<(f64, &Value)> = Vec::new();
    let mut listed = 0;
    for (key, published, committed) in [
        ("replicas", "published_at", "committed_at"),
        ("transfers", "finished_at", "committed_at"),
    ] {
        let all = out[key].as_array().map_or(&[][..], Vec::as_slice);
        listed = listed.max(all.len());
        for r in all {
            if r["state"] != "published" {
                continue;
            }
            let Some(done) = r[published].as_i64().filter(|d| now - d <= SLOW_WINDOW_MS) else {
                continue;
            };
            // A pushed directory is committed when it is pushed.
            let Some(from) = r[committed].as_i64().or(r["created_at"].as_i64()) else {
                continue;
            };
            let took = r["commit_to_replica_s"]
                .as_f64()
                .unwrap_or((done - from) as f64 / 1000.0);
            rows.push((took, r));
        }
    }
    let capped = if listed >= MAX_ITEMS {
        format!(" (of the newest {MAX_ITEMS} rows; older ones were not read)")
    } else {
        String::new()
    };
    if rows.is_empty() {
        return format!("no replica published in the last 24 hours{capped}\n");
    }
    rows.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut t = vec![vec![
        "ID".to_string(),
        "COMMIT TO READY".into(),
        "LONGEST PHASE".into(),
        "JOB".into(),
        "CHECKPOINT".into(),
        "PHASES AFTER THE COMMIT, S".into(),
    ]];
    for (took, r) in rows.iter().take(n) {
        let p = &r["phases"];
        let after = p["after_commit"].as_object();
        let longest = match (p["dominant"].as_str(), after) {
            (Some(d), Some(a)) => {
                let secs = a.get(d).and_then(Value::as_f64).unwrap_or(0.0);
                let share = if *took > 0.0 {
                    100.0 * secs / took
                } else {
                    0.0
                };
                format!("{d} ({secs:.1} s, {share:.0} %)")
            }
            _ => "unknown (no phases recorded)".into(),
        };
        let phases = after
            .map(|a| {
                ferry_proto::phases::Phase::ALL
                    .iter()
                    .filter_map(|ph| {
                        let v = a.get(ph.as_str())?.as_f64()?;
                        Some(format!("{ph} {v:.1}"))
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        let unattributed = p["unattributed_s"]
            .as_f64()
            .filter(|u| u.abs() >= 0.05)
            .map_or(String::new(), |u| format!(", unattributed {u:.1}"));
        t.push(vec![
            int(r, "id").to_string(),
            format!("{took:.1} s"),
            longest,
            text(r, "job").into(),
            text(r, "rel").into(),
            format!("{phases}{unattributed}"),
        ]);
    }
    format!(
        "slowest {} of {} published in the last 24 hours{capped} (unattributed: the commit's \
         trip between the agents and their clocks' skew)\n{}",
        t.len() - 1,
        rows.len(),
        table(&t)
    )
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// A Unix-ms time as RFC 3339 UTC, to the second.
fn at(ms: i64) -> String {
    let t = UNIX_EPOCH + Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

fn int(v: &Value, key: &str) -> i64 {
    v[key].as_i64().unwrap_or(0)
}

fn text<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or("?")
}

/// One line for an admission answer (`admission` of `POST
/// /v1/transfers`): in time or not, when, and what would make it.
pub fn admission_line(a: &Value) -> String {
    let ms = |k: &str| a[k].as_i64().unwrap_or(0);
    let eta_in = (ms("eta_ms") - ferry_catalog::now_ms()) as f64 / 1000.0;
    let spare = (ms("deadline_ms") - ms("eta_ms")) as f64 / 1000.0;
    if a["feasible"] == Value::Bool(true) {
        return format!(
            "deadline feasible: ready in about {eta_in:.1} s at the current queue and rates, \
             {spare:.1} s before the deadline"
        );
    }
    let mut line = format!(
        "deadline NOT feasible: ready in about {eta_in:.1} s at the current queue and rates, \
         {:.1} s after the deadline (margin {:.1} s)",
        -spare,
        ms("margin_ms") as f64 / 1000.0
    );
    if let Some(c) = a["class_needed"].as_str() {
        line.push_str(&format!(
            "; class {c} would make it (ferry push --class {c})"
        ));
    } else if let Some(b) = a["bytes_over"].as_u64() {
        line.push_str(&format!(
            "; no class makes it: {:.2} GB over budget",
            b as f64 / 1e9
        ));
    }
    if let Some(e) = a["endangers"].as_array().filter(|e| !e.is_empty()) {
        line.push_str(&format!("; it would make transfers {e:?} miss theirs"));
    }
    line
}

/// Size of a transfer's checkpoint as far as known: the catalog's, or the
/// live count of a checkpoint still being written (the catalog's is 0
/// until its commit, or the announced size).
pub fn transfer_total(t: &Value) -> u64 {
    let catalog = int(t, "bytes_total").max(0) as u64;
    catalog.max(t["progress"]["bytes_total"].as_u64().unwrap_or(0))
}

/// True while a transfer's checkpoint is being written (`announced` or
/// `open`): its size is not final.
pub fn transfer_writing(t: &Value) -> bool {
    matches!(
        t["checkpoint"].as_str().and_then(|c| c.parse().ok()),
        Some(CheckpointState::Open | CheckpointState::Announced)
    )
}

/// The `state` of a transfer or replica in an API answer; `None` when it
/// is missing or a state this client does not know (a newer server).
fn state_of(v: &Value) -> Option<TransferState> {
    v["state"].as_str()?.parse().ok()
}

/// Bytes done of a transfer: the live count while it moves (what the sink
/// had at the start plus what was sent since), never less than the
/// catalog's, never above the total (resends count once).
pub fn transfer_done(t: &Value) -> u64 {
    let total = transfer_total(t);
    if state_of(t) == Some(TransferState::Published) {
        return total;
    }
    let live = t["progress"]["bytes_sent"].as_u64().unwrap_or(0)
        + t["progress"]["bytes_skipped"].as_u64().unwrap_or(0);
    live.min(total).max(int(t, "bytes_done").max(0) as u64)
}

/// `DONE / TOTAL` and the percentage of a transfer; while its checkpoint
/// is written, `DONE / ≥ KNOWN` and no percentage.
fn transfer_amount(t: &Value) -> (String, String) {
    let (done, total) = (transfer_done(t), transfer_total(t));
    if transfer_writing(t) {
        (
            format!("{} / ≥ {}", HumanBytes(done), HumanBytes(total.max(done))),
            "-".into(),
        )
    } else {
        let done = done.min(total);
        (
            format!("{} / {}", HumanBytes(done), HumanBytes(total)),
            percent(done, total),
        )
    }
}

/// `DONE / TOTAL` and the percentage of a replica at the sink. The sink
/// learns a checkpoint's final size only with its commit: while a
/// receiving replica has every byte it knows of, more may come (a
/// checkpoint still being written), so it shows `≥` and no percentage.
fn replica_amount(r: &Value) -> (String, String) {
    let total = int(r, "bytes_total").max(0) as u64;
    let done = if state_of(r) == Some(TransferState::Published) {
        total
    } else {
        (int(r, "bytes_done").max(0) as u64).min(total)
    };
    if state_of(r) == Some(TransferState::Receiving) && done >= total {
        (
            format!("{} / ≥ {}", HumanBytes(done), HumanBytes(total)),
            "-".into(),
        )
    } else {
        (
            format!("{} / {}", HumanBytes(done), HumanBytes(total)),
            percent(done, total),
        )
    }
}

fn percent(done: u64, total: u64) -> String {
    if total == 0 {
        "-".into()
    } else {
        format!("{:.1}", 100.0 * done as f64 / total as f64)
    }
}

/// Counts per state, in `order` first, then any other, as `2 active, 1
/// queued`.
fn count_states(items: &[Value], order: &[TransferState]) -> String {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for i in items {
        *counts
            .entry(i["state"].as_str().unwrap_or("?"))
            .or_default() += 1;
    }
    let mut parts = Vec::new();
    for s in order.iter().map(|s| s.as_str()) {
        if let Some(n) = counts.remove(s) {
            parts.push(format!("{n} {s}"));
        }
    }
    parts.extend(counts.into_iter().map(|(s, n)| format!("{n} {s}")));
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join(", ")
    }
}

/// Left-aligned columns separated by two spaces; the last is not padded.
fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut width = vec![0; cols];
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            width[i] = width[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in rows {
        let mut line = String::from(" ");
        for (i, c) in r.iter().enumerate() {
            line.push(' ');
            if i + 1 == r.len() {
                line += c;
            } else {
                line += &format!("{c:<w$} ", w = width[i]);
            }
        }
        out += line.trim_end();
        out.push('\n');
    }
    out
}

/// The human form of `ferry status` (see [`status`] for `out`'s keys).
pub fn render_status(base: &str, out: &Value, now_ms: i64) -> String {
    let h = &out["healthz"];
    let roles: Vec<&str> = h["roles"]
        .as_array()
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut s = format!(
        "agent {} ({}) at {base}\n",
        text(h, "agent"),
        if roles.is_empty() {
            "no role".into()
        } else {
            roles.join(" and ")
        }
    );
    if let Some(gone) = out["unavailable"].as_object() {
        for (key, why) in gone {
            s += &format!("{key}: not available: {}\n", why.as_str().unwrap_or("?"));
        }
    }
    if let Some(links) = out["links"].as_array() {
        if links.is_empty() {
            s += "links: none\n";
        }
        for l in links {
            let cap = l["rate_bps"]
                .as_u64()
                .map_or("none".into(), crate::config::format_rate);
            s += &format!("link {}: rate cap {cap}\n", text(l, "name"));
        }
    }
    if let Some(ts) = out["transfers"].as_array() {
        s += &format!(
            "transfers: {}\n",
            count_states(
                ts,
                &[
                    TransferState::Active,
                    TransferState::Verifying,
                    TransferState::Paused,
                    TransferState::Queued,
                    TransferState::Published,
                    TransferState::Failed,
                    TransferState::Cancelled,
                ]
            )
        );
        let rank = |t: &Value| match state_of(t) {
            Some(TransferState::Active) => 0,
            Some(TransferState::Verifying) => 1,
            Some(TransferState::Paused) => 2,
            _ => 3,
        };
        let mut open: Vec<&Value> = ts
            .iter()
            .filter(|t| state_of(t).is_some_and(|s| !s.is_final()))
            .collect();
        open.sort_by_key(|t| (rank(t), int(t, "id")));
        let mut promoted = Vec::new();
        if !open.is_empty() {
            let mut rows = vec![vec![
                "ID".into(),
                "STATE".into(),
                "CLASS".into(),
                "JOB".into(),
                "DONE / TOTAL".into(),
                "%".into(),
                "PATH".into(),
            ]];
            for t in &open {
                let (amount, pct) = transfer_amount(t);
                let urgent_until = t["urgent_until"].as_i64().filter(|u| *u > now_ms);
                let class = match urgent_until {
                    Some(u) => {
                        promoted.push((int(t, "id"), u));
                        "urgent*".to_string()
                    }
                    None => text(t, "class").to_string(),
                };
                rows.push(vec![
                    int(t, "id").to_string(),
                    text(t, "state").into(),
                    class,
                    text(t, "job").into(),
                    amount,
                    pct,
                    text(t, "source_path").into(),
                ]);
            }
            s += &table(&rows);
        }
        for (id, until) in promoted {
            s += &format!(
                "  * transfer {id}: urgent because of a signal until {}\n",
                at(until)
            );
        }
        for t in &open {
            if let Some(e) = t["error"].as_str() {
                s += &format!("  transfer {}: {e}\n", int(t, "id"));
            }
        }
        if let Some(p) = ts
            .iter()
            .find(|t| state_of(t) == Some(TransferState::Published))
        {
            s += &format!(
                "latest published: transfer {} {} -> {} at {}\n",
                int(p, "id"),
                text(p, "source_path"),
                text(p, "local_path"),
                p["finished_at"].as_i64().map_or("?".into(), at)
            );
        }
        if let Some(f) = ts
            .iter()
            .take(20)
            .find(|t| state_of(t) == Some(TransferState::Failed))
        {
            s += &format!(
                "latest failure: transfer {} {}: {}\n",
                int(f, "id"),
                text(f, "source_path"),
                f["error"].as_str().unwrap_or("no reason given")
            );
        }
    }
    if let Some(rs) = out["replicas"].as_array() {
        s += &format!(
            "replicas: {}\n",
            count_states(
                rs,
                &[
                    TransferState::Receiving,
                    TransferState::Published,
                    TransferState::Failed,
                    TransferState::Cancelled,
                ],
            )
        );
        let incoming: Vec<&Value> = rs
            .iter()
            .filter(|r| state_of(r) == Some(TransferState::Receiving))
            .collect();
        if !incoming.is_empty() {
            let mut rows = vec![vec![
                "ID".into(),
                "STATE".into(),
                "JOB".into(),
                "DONE / TOTAL".into(),
                "%".into(),
                "SOURCE PATH".into(),
            ]];
            for r in incoming {
                let (amount, pct) = replica_amount(r);
                rows.push(vec![
                    int(r, "id").to_string(),
                    text(r, "state").into(),
                    text(r, "job").into(),
                    amount,
                    pct,
                    text(r, "source_path").into(),
                ]);
            }
            s += &table(&rows);
        }
        if let Some(p) = rs
            .iter()
            .find(|r| state_of(r) == Some(TransferState::Published))
        {
            let longest = p["phases"]["dominant"].as_str().and_then(|d| {
                let s = p["phases"]["after_commit"][d].as_f64()?;
                Some(format!(
                    " (longest phase: {} {s:.2} s; ferry status --slow)",
                    d.replace('_', " ")
                ))
            });
            let lag = p["commit_to_replica_s"]
                .as_f64()
                .map_or(String::new(), |l| {
                    format!(
                        ", {l:.2} s after its commit{}",
                        longest.clone().unwrap_or_default()
                    )
                });
            s += &format!(
                "latest replica: {} -> {} at {}{lag}\n",
                text(p, "source_path"),
                // On an HDFS or S3 sink, the URL readers use.
                p["url"].as_str().unwrap_or(text(p, "local_path")),
                p["published_at"].as_i64().map_or("?".into(), at)
            );
        }
    }
    s
}

// ------------------------------------------------------------- resolve --

/// Refuses a relative `PATH` or a `--wait` over the API's longest.
fn check_resolve_args(path: &str, wait: Duration) -> Result<()> {
    if replicator::sink::normalize_source_path(path).is_none() {
        bail!(
            "PATH must be the checkpoint's absolute path at the source (or its hdfs:// or \
             s3:// URL), without `..`, got {path:?}"
        );
    }
    if wait > api::MAX_WAIT {
        bail!(
            "--wait must be at most {}",
            humantime::format_duration(api::MAX_WAIT)
        );
    }
    Ok(())
}

/// `ferry resolve PATH`: asks the sink where the checkpoint `path` (its
/// absolute path at the source) is. Prints the local path, or the URL on
/// an HDFS or S3 sink (exit 0), or the state and progress on stderr and
/// exits with [`NOT_LOCAL_EXIT`].
///
/// # Errors
/// A relative path, an unreachable or refusing agent; [`Exit`] when the
/// path is not local.
pub async fn resolve(
    args: &ServerArgs,
    path: &str,
    wait: Duration,
    full: bool,
    raw: bool,
) -> Result<()> {
    check_resolve_args(path, wait)?;
    let c = Client::new(args, REQUEST_TIMEOUT + wait)?;
    let wait_s = format!("{}ms", wait.as_millis());
    let mut query = vec![("path", path)];
    if !wait.is_zero() {
        query.push(("wait", wait_s.as_str()));
    }
    if full {
        query.push(("profile", "full"));
    }
    let r = c.get("/v1/resolve", &query).await?;
    let local = r["state"] == "local";
    if raw {
        outln!("{r}")?;
    } else if local {
        outln!(
            "{}",
            r["local_path"]
                .as_str()
                .or(r["url"].as_str())
                .unwrap_or("?")
        )?;
        if let Some(p) = r["profile"].as_str() {
            eprintln!(
                "note: a {p} replica (some files of the checkpoint are not here; \
                 --full waits for a full one under a weights-first publish)"
            );
        }
    } else {
        eprintln!("{}", describe_resolution(path, &r));
    }
    if local {
        Ok(())
    } else {
        Err(Exit(NOT_LOCAL_EXIT).into())
    }
}

/// `ferry resolve PATH --lease D [-- COMMAND...]`: resolves with a reader
/// lease of `lease` on the version found. Without a command, prints the
/// leased path (the lease id and expiry on stderr) and leaves the lease
/// to expire. With one, runs it (`{}` in its arguments and FERRY_PATH
/// give the path, FERRY_LEASE the lease id), renews the lease every third
/// of its length while it runs, releases it after, and exits with the
/// command's exit code (128 + the signal's number when a signal ended
/// it).
///
/// # Errors
/// As [`resolve`]; a lease out of range; a command that cannot start
/// (the lease is released first).
pub async fn resolve_leased(
    args: &ServerArgs,
    path: &str,
    wait: Duration,
    lease: Duration,
    command: &[String],
    full: bool,
    raw: bool,
) -> Result<()> {
    check_resolve_args(path, wait)?;
    if lease < Duration::from_secs(1) || lease > Duration::from_secs(7 * 86_400) {
        bail!("--lease must be at least 1s and at most 7d");
    }
    let c = Client::new(args, REQUEST_TIMEOUT + wait)?;
    let wait_s = format!("{}ms", wait.as_millis());
    let lease_s = format!("{}ms", lease.as_millis());
    let mut query = vec![("path", path), ("lease", lease_s.as_str())];
    if !wait.is_zero() {
        query.push(("wait", wait_s.as_str()));
    }
    if full {
        query.push(("profile", "full"));
    }
    let r = c.get("/v1/resolve", &query).await?;
    if r["state"] != "local" {
        if raw {
            outln!("{r}")?;
        } else {
            eprintln!("{}", describe_resolution(path, &r));
        }
        return Err(Exit(NOT_LOCAL_EXIT).into());
    }
    // A local directory's path, or (S3) the version's URL.
    let local = r["local_path"]
        .as_str()
        .or(r["url"].as_str())
        .unwrap_or("?");
    let id = r["lease"]["id"].as_str().unwrap_or_default().to_string();
    if id.is_empty() {
        bail!("the sink answered without a lease: {r}");
    }
    let leases = format!("/v1/leases/{id}");
    if command.is_empty() {
        if raw {
            outln!("{r}")?;
        } else {
            outln!("{local}")?;
            eprintln!(
                "lease {id} on replica {} until {}; renew: POST {leases}/renew, release: DELETE {leases}",
                r["replica"],
                r["lease"]["expires_at"].as_str().unwrap_or("?")
            );
        }
        return Ok(());
    }
    let argv: Vec<String> = command.iter().map(|a| a.replace("{}", local)).collect();
    let mut child = match tokio::process::Command::new(&argv[0])
        .args(&argv[1..])
        .env("FERRY_PATH", local)
        .env("FERRY_LEASE", &id)
        .spawn()
    {
        Ok(ch) => ch,
        Err(e) => {
            let _ = c.delete(&leases, &[]).await;
            bail!("cannot run {:?}: {e} (the lease was released)", argv[0]);
        }
    };
    let every = (lease / 3).max(Duration::from_millis(500));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    // SIGTERM goes to the command, and the lease is held until it ends (a
    // supervisor that signals only this process must not leave the
    // command reading an unprotected version). SIGINT is not passed on:
    // Ctrl-C in a terminal reaches the command already.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("watching for SIGTERM")?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .context("watching for SIGINT")?;
    let pid = child.id().and_then(|p| i32::try_from(p).ok());
    let forward = |sig: nix::sys::signal::Signal| {
        if let Some(p) = pid {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(p), sig);
        }
    };
    let mut lost: Option<String> = None;
    let status = loop {
        tokio::select! {
            st = child.wait() => break st,
            _ = term.recv() => forward(nix::sys::signal::Signal::SIGTERM),
            _ = int.recv() => {}
            _ = tick.tick(), if lost.is_none() => {
                if let Err(e) = c.post(&format!("{leases}/renew"), &json!({})).await {
                    let gone = e
                        .downcast_ref::<crate::client::HttpError>()
                        .is_some_and(|h| h.status == reqwest::StatusCode::GONE || h.status == reqwest::StatusCode::NOT_FOUND);
                    if gone {
                        eprintln!("warning: lease {id} ended: {e:#}; the version the command reads may be deleted under it");
                        lost = Some(format!("{e:#}"));
                    } else {
                        eprintln!("warning: renewing lease {id}: {e:#}; trying again");
                    }
                }
            }
        }
    };
    let status = status.context("waiting for the command")?;
    if lost.is_none() {
        if let Err(e) = c.delete(&leases, &[]).await {
            eprintln!("warning: releasing lease {id}: {e:#}; it expires by itself");
        }
    } else {
        eprintln!("warning: the command ran past its lease (lease {id} ended before it did)");
    }
    let code = status.code().unwrap_or_else(|| {
        use std::os::unix::process::ExitStatusExt;
        128 + status.signal().unwrap_or(0)
    });
    if code == 0 {
        Ok(())
    } else {
        Err(Exit(code).into())
    }
}

/// One line saying where a path that is not local is.
pub fn describe_resolution(path: &str, r: &Value) -> String {
    match r["state"].as_str() {
        Some("replicating") => {
            let total = r["bytes_total"].as_u64().unwrap_or(0);
            let done = r["bytes_done"].as_u64().unwrap_or(0).min(total);
            let eta = r["eta_s"]
                .as_f64()
                .map_or(String::new(), |e| format!(", about {e:.0} s to go"));
            format!(
                "replicating: {} of {} ({} %){eta}; not local yet",
                HumanBytes(done),
                HumanBytes(total),
                percent(done, total)
            )
        }
        Some("remote") => format!(
            "remote: {path} has no replica at this sink ({})",
            r["reason"].as_str().unwrap_or("no reason known")
        ),
        Some("unknown") => {
            format!("unknown: this sink has not heard of {path} (not pushed or announced yet?)")
        }
        _ => format!("unexpected answer: {r}"),
    }
}

// -------------------------------------------------------------- signal --

/// Fields of `ferry signal`.
#[derive(Debug, Clone)]
pub struct SignalArgs {
    /// Job name.
    pub job: String,
    /// Signal kind (`loss_spike`, ...).
    pub kind: String,
    /// Severity, 0..1.
    pub severity: f64,
    /// Training step, if known.
    pub step: Option<i64>,
    /// Retry key.
    pub idempotency_key: Option<String>,
}

/// One line for a replica: id, state, job, step, bytes, pin or removal,
/// local path.
fn replica_line(r: &Value) -> String {
    let step = r["step"]
        .as_i64()
        .map_or_else(|| "-".to_string(), |s| s.to_string());
    let mut extra = String::new();
    if let Some(p) = r["pin"].as_object() {
        let until = p
            .get("until")
            .and_then(Value::as_i64)
            .map_or_else(String::new, |u| format!(" until {}", at(u)));
        extra = format!(
            " pinned{until} ({})",
            p.get("reason").and_then(Value::as_str).unwrap_or("")
        );
    }
    if let Some(m) = r["removal"].as_object() {
        let s = |k: &str| m.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        let when = m
            .get("finished_at")
            .or(m.get("started_at"))
            .and_then(Value::as_i64)
            .map_or_else(String::new, at);
        let forced = if m.get("forced").and_then(Value::as_bool) == Some(true) {
            ", forced"
        } else {
            ""
        };
        extra = format!(" {} {when}{forced}: {}", s("reason"), s("detail"));
    }
    if let Some(u) = r["leased_until"].as_i64() {
        let n = r["leases"].as_array().map_or(0, Vec::len);
        extra = format!(
            "{extra} leased until {} ({n} lease{})",
            at(u),
            if n == 1 { "" } else { "s" }
        );
    }
    // A published version a re-save replaced: its files stay only while
    // a lease holds them.
    let state = match r["replaced_by"].as_i64() {
        Some(by) => {
            extra = format!(" (replaced by {by}){extra}");
            "replaced"
        }
        None => text(r, "state"),
    };
    format!(
        "{:>6} {:<10} {} step {step} {} B{extra}  {}",
        int(r, "id"),
        state,
        text(r, "job"),
        int(r, "bytes_total"),
        r["url"].as_str().unwrap_or(text(r, "local_path")),
    )
}

/// `ferry replica ls`: a page of `GET /v1/replicas`, one line each.
///
/// # Errors
/// As [`Client::get`].
pub async fn replica_ls(args: &ServerArgs, state: Option<&str>, raw: bool) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let mut q = vec![("limit", "1000")];
    if let Some(s) = state {
        q.push(("state", s));
    }
    let page = c.get("/v1/replicas", &q).await?;
    if raw {
        return outln!("{page}");
    }
    for r in page["items"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        outln!("{}", replica_line(r))?;
    }
    Ok(())
}

/// `ferry replica rm`: `DELETE /v1/replicas/{id}`.
///
/// # Errors
/// As [`Client::delete`]: the agent's refusal (unknown id, pinned without
/// `--force`, not published) names why.
pub async fn replica_rm(
    args: &ServerArgs,
    id: i64,
    force: bool,
    reason: Option<&str>,
    raw: bool,
) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let mut q = Vec::new();
    if force {
        q.push(("force", "true"));
    }
    if let Some(r) = reason {
        q.push(("reason", r));
    }
    let (_, r) = c.delete(&format!("/v1/replicas/{id}"), &q).await?;
    if raw {
        return outln!("{r}");
    }
    outln!(
        "replica {id} removed from {} (its files are being deleted)",
        r["url"].as_str().unwrap_or(text(&r, "local_path"))
    )
}

/// `ferry replica pin`: `POST /v1/replicas/{id}/pin`.
///
/// # Errors
/// As [`Client::post`].
pub async fn replica_pin(
    args: &ServerArgs,
    id: i64,
    reason: Option<String>,
    for_: Option<String>,
    raw: bool,
) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let mut body = json!({});
    if let Some(r) = reason {
        body["reason"] = json!(r);
    }
    if let Some(f) = for_ {
        body["for"] = json!(f);
    }
    let (_, r) = c.post(&format!("/v1/replicas/{id}/pin"), &body).await?;
    if raw {
        return outln!("{r}");
    }
    outln!("{}", replica_line(&r))
}

/// `ferry replica unpin`: `DELETE /v1/replicas/{id}/pin`.
///
/// # Errors
/// As [`Client::delete`].
pub async fn replica_unpin(args: &ServerArgs, id: i64, raw: bool) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let (_, r) = c.delete(&format!("/v1/replicas/{id}/pin"), &[]).await?;
    if raw {
        return outln!("{r}");
    }
    outln!("{}", replica_line(&r))
}

/// `ferry pool`: `GET /v1/pool`, one line per agent of the site's pool.
///
/// # Errors
/// As [`Client::get`]; when the agent's catalog does not answer, what the
/// agent knows is printed and the command fails saying so.
pub async fn pool(args: &ServerArgs, raw: bool) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let out = c.get("/v1/pool", &[]).await?;
    if raw {
        outln!("{out}")?;
    } else {
        outln!("{}", render_pool(&out).trim_end())?;
    }
    if out["catalog_up"].as_bool() == Some(false) {
        bail!(
            "the agent at {} cannot see its pool: its catalog does not answer",
            c.base()
        );
    }
    Ok(())
}

/// The human form of `ferry pool` (`out`: the answer of `GET /v1/pool`).
pub fn render_pool(out: &Value) -> String {
    let agents = out["agents"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let down = out["catalog_up"].as_bool() == Some(false);
    let mut s = if down && agents.is_empty() {
        format!("pool not known (seen from {}", text(out, "agent"))
    } else {
        format!(
            "pool of {} agent{} (seen from {}",
            agents.len(),
            if agents.len() == 1 { "" } else { "s" },
            text(out, "agent")
        )
    };
    if down {
        s += &format!(
            "; its catalog does not answer: {}",
            text(out, "catalog_error")
        );
    } else if let Some(e) = out["catalog_error"].as_str() {
        // The catalog answers but refuses this agent (e.g. another
        // process runs under its name).
        s += &format!("; this agent is not in the pool: {e}");
    }
    s += ")\n";
    let mut rows = vec![vec![
        "AGENT".to_string(),
        "ROLE".into(),
        "STATE".into(),
        "HEARTBEAT".into(),
        "HOLDS".into(),
        "SENT".into(),
        "RECEIVED".into(),
        "VERSION".into(),
    ]];
    for a in agents {
        let rate = |k: &str| crate::config::format_rate(a[k].as_f64().unwrap_or(0.0) as u64);
        rows.push(vec![
            text(a, "name").to_string(),
            text(a, "role").to_string(),
            text(a, "state").to_string(),
            format!("{:.1}s ago", a["heartbeat_age_s"].as_f64().unwrap_or(0.0)),
            format!(
                "{} ({} left){}",
                a["held"].as_i64().unwrap_or(0),
                HumanBytes(a["held_bytes_left"].as_i64().unwrap_or(0).max(0) as u64),
                match a["watches"].as_i64().unwrap_or(0) {
                    0 => String::new(),
                    1 => ", watches 1 root".into(),
                    n => format!(", watches {n} roots"),
                }
            ),
            rate("sent_bps"),
            rate("received_bps"),
            text(a, "version").to_string(),
        ]);
    }
    let mut s = s + &table(&rows);
    let watches = out["watches"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    if !watches.is_empty() {
        s += "\nwatched roots:\n";
        let mut rows = vec![vec![
            "ROOT".to_string(),
            "WATCHED BY".into(),
            "REFUSED BY".into(),
        ]];
        for w in watches {
            let by = match (w["holder"].as_str(), w["live"].as_bool()) {
                (Some(h), Some(true)) => h.to_string(),
                (Some(h), _) => format!("nobody ({h}'s lease lapsed)"),
                (None, _) => "nobody".into(),
            };
            let refused: Vec<String> = w["refused"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or(&[])
                .iter()
                .map(|r| format!("{}: {}", text(r, "agent"), text(r, "reason")))
                .collect();
            rows.push(vec![
                text(w, "root").to_string(),
                by,
                if refused.is_empty() {
                    "-".into()
                } else {
                    refused.join("; ")
                },
            ]);
        }
        s += &table(&rows);
    }
    s
}

/// `ferry pool settings` (`GET /v1/settings`): the settings the agent
/// uses, as a table or the API's JSON.
///
/// # Errors
/// As [`Client::get`].
pub async fn pool_settings(args: &ServerArgs, raw: bool) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let out = c.get("/v1/settings", &[]).await?;
    if raw {
        return outln!("{out}");
    }
    outln!("{}", render_settings(&out).trim_end())
}

/// The human form of `ferry pool settings` (`out`: the answer of `GET
/// /v1/settings` or `PUT /v1/settings/{name}`).
pub fn render_settings(out: &Value) -> String {
    let shared = out["shared"].as_bool() == Some(true);
    let mut s = if shared {
        "settings of the pool (stored in its catalog; every agent uses them)\n".to_string()
    } else {
        "settings of this single agent (from its config file)\n".to_string()
    };
    let mut rows = vec![vec!["SETTING".to_string(), "VALUE".into(), "SET BY".into()]];
    for i in out["items"].as_array().map(Vec::as_slice).unwrap_or(&[]) {
        let name = text(i, "name").to_string();
        let value = replicator::settings::display_value(&name, &i["value"]);
        let by = i["updated_by"].as_str().unwrap_or("config").to_string();
        rows.push(vec![name, value, by]);
    }
    s += &table(&rows);
    s
}

/// `ferry pool forget NAME` (`DELETE /v1/agents/NAME`).
///
/// # Errors
/// As [`Client::delete`]: 404 for an unknown agent, 409 for a live one.
pub async fn pool_forget(args: &ServerArgs, name: &str) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    c.delete(&format!("/v1/agents/{name}"), &[]).await?;
    outln!("{name} is no longer listed in the pool (it registers anew if it starts again)")
}

/// `ferry pool set KEY VALUE` (`PUT /v1/settings/{KEY}` with the value as
/// typed; the agent reads it by the setting's kind).
///
/// # Errors
/// As [`Client::put`]: 404 for an unknown link or job, 409 for a
/// scheduler setting on a single agent, 422 naming a bad key or value.
pub async fn pool_set(args: &ServerArgs, key: &str, value: &str, raw: bool) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let (_, out) = c
        .put(&format!("/v1/settings/{key}"), &json!({ "value": value }))
        .await?;
    if raw {
        return outln!("{out}");
    }
    let now = out["items"]
        .as_array()
        .and_then(|a| a.iter().find(|i| i["name"] == key))
        .map(|i| replicator::settings::display_value(key, &i["value"]));
    match (now, out["shared"].as_bool() == Some(true)) {
        (Some(v), true) => {
            outln!("{key} = {v} (every agent of the pool applies it within about a second)")
        }
        (Some(v), false) => outln!("{key} = {v} (this agent, until it restarts)"),
        (None, _) => outln!("{key} set to {value}"),
    }
}

/// `ferry drain NAME` (`POST /v1/agents/{name}/drain`), or with `undo`
/// its reversal (`DELETE`); with `wait`, polls `GET /v1/pool` until the
/// drained agent holds nothing (at most `wait`).
///
/// # Errors
/// As [`Client::post`] (404 for an agent not in the pool); a wait that
/// runs out names what the agent still holds.
pub async fn drain(
    args: &ServerArgs,
    name: &str,
    undo: bool,
    wait: Option<Duration>,
    raw: bool,
) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let path = format!("/v1/agents/{name}/drain");
    let (_, r) = if undo {
        c.delete(&path, &[]).await?
    } else {
        c.post(&path, &json!({})).await?
    };
    if raw {
        return outln!("{r}");
    }
    if undo {
        return outln!("{name}: no longer drained; it claims transfers again");
    }
    outln!(
        "{name}: drained; it claims nothing new and holds {} transfer(s) now",
        r["held"].as_i64().unwrap_or(0)
    )?;
    let Some(wait) = wait else { return Ok(()) };
    let until = std::time::Instant::now() + wait;
    loop {
        let pool = c.get("/v1/pool", &[]).await?;
        let me = pool["agents"]
            .as_array()
            .and_then(|a| a.iter().find(|x| x["name"] == name).cloned())
            .unwrap_or_default();
        let held = me["held"].as_i64().unwrap_or(0);
        let watches = me["watches"].as_i64().unwrap_or(0);
        if held == 0 && watches == 0 {
            return outln!("{name}: holds nothing");
        }
        if std::time::Instant::now() >= until {
            anyhow::bail!(
                "{name} still holds {held} transfer(s) and watches {watches} root(s) after {}",
                humantime::format_duration(wait)
            );
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// `ferry signal`: `POST /v1/signals` on the source.
///
/// # Errors
/// The agent cannot be reached or refuses (401, 403, 404 unknown job,
/// 422 naming the field).
pub async fn signal(args: &ServerArgs, s: &SignalArgs, raw: bool) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let body = json!({
        "job": s.job,
        "kind": s.kind,
        "severity": s.severity,
        "step": s.step,
        "idempotency_key": s.idempotency_key,
    });
    let (_, out) = c.post("/v1/signals", &body).await?;
    if raw {
        outln!("{out}")
    } else {
        crate::out::print(format_args!("{}", render_signal(&out)))
    }
}

/// The human form of a signal's outcome.
pub fn render_signal(out: &Value) -> String {
    let sig = &out["signal"];
    let step = sig["step"]
        .as_i64()
        .map_or(String::new(), |s| format!(" at step {s}"));
    let mut s = if out["new"] == false {
        format!(
            "idempotency key seen before: signal {} was stored earlier and nothing changed now; it had done this:\n",
            int(sig, "id")
        )
    } else {
        String::new()
    };
    s += &format!(
        "signal {} stored: {} for job {}, severity {}{step}\n",
        int(sig, "id"),
        text(sig, "kind"),
        text(sig, "job"),
        sig["severity"].as_f64().unwrap_or(f64::NAN)
    );
    match out["promoted"].as_i64() {
        Some(id) => {
            let until = out["urgent_until"].as_i64().map_or("?".into(), at);
            let state = out["promoted_state"].as_str().unwrap_or("?");
            s += &format!("transfer {id} ({state}) is urgent until {until}\n");
            if state.parse() == Ok(TransferState::Paused) {
                s += "it is paused: it moves as urgent once resumed\n";
            }
        }
        None => {
            s += "no unpublished checkpoint of this job to promote; the job's score rises (the severity halves every half-life)\n";
        }
    }
    for p in out["pins"].as_array().into_iter().flatten() {
        s += &format!("pins at the sinks: {}\n", p.as_str().unwrap_or("?"));
    }
    s
}

// --------------------------------------------------------------- trace --

/// Where `ferry trace --since` starts the trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Since {
    /// This long before now (`--since 24h`).
    Ago(Duration),
    /// At this time (`--since 2025-06-01T00:00:00Z`).
    At(SystemTime),
}

/// Parses `--since`: a duration before now (`24h`, `90m`, `7days`, as
/// humantime reads them) or an RFC 3339 time in UTC (`2025-06-01T00:00:00Z`,
/// also without the `Z` or with a space for the `T`).
///
/// # Errors
/// Neither, with examples of both.
pub fn parse_since(s: &str) -> Result<Since, String> {
    let t = s.trim();
    if let Ok(d) = humantime::parse_duration(t) {
        return Ok(Since::Ago(d));
    }
    if let Ok(at) = humantime::parse_rfc3339_weak(t) {
        return Ok(Since::At(at));
    }
    Err(format!(
        "{s:?} is neither a duration before now (24h, 90m, 7days) nor an RFC 3339 time in UTC \
         (2025-06-01T00:00:00Z)"
    ))
}

impl Since {
    /// The start as Unix ms, given the time now (Unix ms); a duration
    /// reaching before 1970 starts at 0 (everything recorded).
    pub fn unix_ms(self, now_ms: i64) -> i64 {
        match self {
            Since::Ago(d) => now_ms
                .saturating_sub(i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
                .max(0),
            Since::At(t) => t
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        }
    }
}

/// `ferry trace`: `GET /v1/trace?since=` on the source, checked to be a
/// trace this version reads, written to `out` (or stdout). Says on stderr
/// what was written when it goes to a file.
///
/// # Errors
/// The agent cannot be reached or refuses (401, 403: it needs an operator
/// token); the answer is not a trace; `out` cannot be written.
pub async fn trace(args: &ServerArgs, since: Option<Since>, out: Option<&Path>) -> Result<()> {
    let c = Client::new(args, REQUEST_TIMEOUT)?;
    let now = now_ms();
    let since_ms = since.map_or(0, |s| s.unix_ms(now));
    if since_ms > now {
        anyhow::bail!("--since is in the future: nothing has been recorded after it yet");
    }
    let text = c
        .get_text("/v1/trace", &[("since", &since_ms.to_string())])
        .await?;
    let t = scheduler::trace::Trace::parse(&text).with_context(|| {
        format!(
            "GET /v1/trace: the answer of {} is not a trace this ferry reads",
            c.base()
        )
    })?;
    let Some(path) = out else {
        return crate::out::print(format_args!("{text}"));
    };
    std::fs::write(path, &text).with_context(|| format!("-o {}", path.display()))?;
    let from = if since_ms == 0 {
        "the start of the recorded history".to_string()
    } else {
        at(since_ms)
    };
    eprintln!(
        "wrote {}: {} events ({} transfers) from {from}, {} links, {} jobs; replay it with: ferry replay {}",
        path.display(),
        t.events.len(),
        t.arrivals(),
        t.header.links.len(),
        t.header.jobs.len(),
        path.display()
    );
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn since_is_a_duration_before_now_or_a_utc_time() {
        let now = 1_750_000_000_000;
        let ms = |s: &str| parse_since(s).unwrap().unix_ms(now);
        assert_eq!(ms("24h"), now - 24 * 3_600_000);
        assert_eq!(ms(" 90m "), now - 90 * 60_000);
        assert_eq!(ms("0s"), now);
        assert_eq!(ms("2025-06-01T00:00:00Z"), 1_748_736_000_000);
        assert_eq!(ms("2025-06-01 00:00:00"), 1_748_736_000_000);
        assert_eq!(ms("100years"), 0, "before 1970: everything recorded");
        for bad in [
            "yesterday",
            "-1h",
            "",
            "2025-13-01T00:00:00Z",
            "1750000000000",
        ] {
            let e = parse_since(bad).unwrap_err();
            assert!(e.contains("24h") && e.contains("RFC 3339"), "{bad}: {e}");
        }
    }

    #[test]
    fn token_new_prints_the_token_once_and_an_entry_that_parses_back() {
        let (token, out) = token_new(api::Role::Signaler, Some("trainer \"7\"")).unwrap();
        let mut lines = out.lines();
        assert_eq!(lines.next(), Some(token.as_str()), "the token comes first");
        assert_eq!(out.matches(&token).count(), 1, "the token is shown once");
        assert!(out.contains("shown only now") && out.contains("only its hash"));
        // The rest is TOML to paste: parsed as the agent's config does.
        let rest: String = lines.map(|l| format!("{l}\n")).collect();
        #[derive(serde::Deserialize)]
        struct Doc {
            api: crate::config::ApiSection,
        }
        let doc: Doc = toml::from_str(&format!("[api]\n{rest}")).unwrap();
        let entry = &doc.api.tokens[0];
        assert_eq!(
            (entry.name.as_str(), entry.role.as_str()),
            ("trainer \"7\"", "signaler")
        );
        assert_eq!(entry.hash, api::auth::hash_token(&token));
        let auth = doc.api.auth().unwrap();
        let hv = format!("Bearer {token}").parse().unwrap();
        let caller = auth.authenticate(Some(&hv)).unwrap();
        assert_eq!(caller.role, api::Role::Signaler);
        // Without --name: the role and a piece of the hash, never of the token.
        let (token, out) = token_new(api::Role::Reader, None).unwrap();
        let name = out.lines().find(|l| l.starts_with("name = ")).unwrap();
        assert!(name.starts_with("name = \"reader-"), "{name}");
        assert!(!name.contains(&token[6..14]), "{name}");
        assert!(token_new(api::Role::Reader, Some(" ")).is_err());
    }

    #[test]
    fn a_replaced_version_reads_replaced_naming_the_newer() {
        let r = json!({"id": 3, "state": "published", "job": "j", "bytes_total": 10,
                       "local_path": "/e/s", "replaced_by": 7});
        let line = replica_line(&r);
        assert!(
            line.contains("replaced") && line.contains("(replaced by 7)"),
            "{line}"
        );
        assert!(!line.contains("published"), "{line}");
        let r = json!({"id": 7, "state": "published", "job": "j", "bytes_total": 10,
                       "local_path": "/e/s"});
        assert!(replica_line(&r).contains("published"));
        assert!(!replica_line(&r).contains("leased"));
        let r = json!({"id": 3, "state": "published", "job": "j", "bytes_total": 10,
                       "local_path": "/e/s", "replaced_by": 7,
                       "leased_until": 1_800_000_000_000_i64, "leases": [{"id": "ab"}]});
        let line = replica_line(&r);
        assert!(
            line.contains("leased until 2027-") && line.contains("(1 lease)"),
            "{line}"
        );
    }

    #[test]
    fn a_pool_whose_catalog_does_not_answer_is_not_shown_as_empty() {
        let out = json!({"agent": "train-a-1", "catalog_up": false,
                         "catalog_error": "no answer within 3 s", "agents": []});
        let s = render_pool(&out);
        assert!(
            s.starts_with("pool not known (seen from train-a-1; its catalog does not answer: no answer within 3 s)"),
            "{s}"
        );
        assert!(!s.contains("0 agents"), "{s}");
    }

    #[test]
    fn settings_show_rates_and_sizes_as_written() {
        let out = json!({"shared": true, "items": [
            {"name": "link.to-eval.rate", "value": 2_000_000_000u64, "updated_by": "ops"},
            {"name": "scheduler.small_transfer", "value": 33_554_432u64},
            {"name": "scheduler.policy", "value": "priority"},
            {"name": "scheduler.max_active", "value": 4},
        ]});
        let s = render_settings(&out);
        for want in ["2Gbit/s", "32MiB", "priority", " 4 ", "ops", "config"] {
            assert!(s.contains(want), "{want}: {s}");
        }
        assert!(!s.contains("33554432"), "{s}");
        assert_eq!(
            replicator::settings::display_value("scheduler.small_transfer", &json!(1000)),
            "1000B"
        );
    }

    #[test]
    fn slow_lists_the_slowest_recent_replicas_with_their_longest_phase() {
        let now = 100 * 3600 * 1000;
        let rep = |id: i64, took: f64, ago_h: i64, dominant: &str| {
            json!({"id": id, "state": "published", "job": "llama-7b", "rel": format!("step_{id}"),
                   "published_at": now - ago_h * 3600 * 1000, "committed_at": 1,
                   "commit_to_replica_s": took,
                   "phases": {"after_commit": {dominant: took * 0.75, "publishing": took * 0.25},
                              "dominant": dominant, "unattributed_s": 0.0}})
        };
        let out = json!({"replicas": [
            rep(1, 12.0, 1, "sending"),
            rep(2, 80.0, 30, "queued"),
            rep(3, 40.0, 2, "queued"),
            rep(4, 3.0, 3, "verifying"),
            {"id": 5, "state": "receiving", "job": "x", "rel": "step_5"},
        ]});
        let s = render_slow(&out, 2, now);
        let lines: Vec<&str> = s.lines().collect();
        assert!(lines[0].contains("slowest 2 of 3 published"), "{s}");
        // Slowest first; the one published 30 h ago is left out.
        assert!(
            lines[2].trim_start().starts_with("3 ")
                && lines[2].contains("40.0 s")
                && lines[2].contains("queued (30.0 s, 75 %)"),
            "{s}"
        );
        assert!(lines[2].contains("queued 30.0, publishing 10.0"), "{s}");
        assert!(
            lines[3].contains("sending (9.0 s, 75 %)") && lines[3].contains("step_1"),
            "{s}"
        );
        assert!(!s.contains("step_2") && !s.contains("step_4"), "{s}");
        // A replica without phases (an older source) still lists.
        let old = json!({"replicas": [{"id": 9, "state": "published", "job": "j", "rel": "r",
            "published_at": now, "committed_at": now - 5_000, "commit_to_replica_s": 5.0}]});
        assert!(render_slow(&old, 10, now).contains("unknown (no phases recorded)"));
        let none = render_slow(&json!({"replicas": []}), 10, now);
        assert!(
            none.starts_with("no replica published in the last 24 hours"),
            "{none}"
        );
    }

    #[test]
    fn status_names_the_parts_the_agent_could_not_give() {
        let out = json!({
            "healthz": {"status": "ok", "agent": "train-a-1", "roles": ["source"]},
            "links": [{"name": "to-eval", "rate_bps": 1_000_000_000u64}],
            "unavailable": {"transfers": "GET /v1/transfers: 503 the catalog does not answer"},
        });
        let s = render_status("http://127.0.0.1:7070", &out, 0);
        assert!(
            s.contains(
                "transfers: not available: GET /v1/transfers: 503 the catalog does not answer\n"
            ),
            "{s}"
        );
        assert!(s.contains("link to-eval: rate cap 1Gbit/s"), "{s}");
    }

    #[test]
    fn status_shows_queue_links_and_replicas() {
        let now = 1_700_000_000_000;
        let out = json!({
            "healthz": {"status": "ok", "agent": "train-a-1", "roles": ["source"]},
            "links": [{"name": "to-eval", "rate_bps": 1_000_000_000u64}],
            "transfers": [
                {"id": 9, "state": "queued", "class": "background", "job": "data",
                 "source_path": "/d/x", "bytes_total": 1000, "bytes_done": 0, "progress": null},
                {"id": 8, "state": "active", "class": "scheduled", "job": "mm",
                 "source_path": "/c/step_2", "bytes_total": 4 << 20, "bytes_done": 0,
                 "urgent_until": now + 60_000,
                 "progress": {"bytes_total": 4 << 20, "bytes_sent": 1 << 20, "bytes_skipped": 0}},
                {"id": 7, "state": "published", "class": "scheduled", "job": "mm",
                 "source_path": "/c/step_1", "local_path": "/e/step_1", "bytes_total": 10,
                 "bytes_done": 10, "finished_at": now},
                {"id": 6, "state": "failed", "class": "scheduled", "job": "mm",
                 "source_path": "/c/step_0", "bytes_total": 10, "error": "sink full"},
            ],
        });
        let s = render_status("http://127.0.0.1:7070", &out, now);
        assert!(
            s.starts_with("agent train-a-1 (source) at http://127.0.0.1:7070\n"),
            "{s}"
        );
        assert!(s.contains("link to-eval: rate cap 1Gbit/s"), "{s}");
        assert!(
            s.contains("transfers: 1 active, 1 queued, 1 published, 1 failed"),
            "{s}"
        );
        let active = s.lines().find(|l| l.contains("/c/step_2")).unwrap();
        for w in [
            "8",
            "active",
            "urgent*",
            "mm",
            "1.00 MiB / 4.00 MiB",
            "25.0",
        ] {
            assert!(active.contains(w), "{active:?} lacks {w:?}");
        }
        // Active rows come before queued ones.
        assert!(
            s.find("/c/step_2").unwrap() < s.find("/d/x").unwrap(),
            "{s}"
        );
        assert!(
            s.contains("transfer 8: urgent because of a signal until 2023-11-14T22:14:20Z"),
            "{s}"
        );
        assert!(
            s.contains("latest published: transfer 7 /c/step_1 -> /e/step_1"),
            "{s}"
        );
        assert!(
            s.contains("latest failure: transfer 6 /c/step_0: sink full"),
            "{s}"
        );

        let sink = json!({
            "healthz": {"agent": "eval-b-1", "roles": ["sink"]},
            "replicas": [
                {"id": 2, "state": "receiving", "job": "mm", "source_path": "/c/step_2",
                 "bytes_total": 200, "bytes_done": 50},
                {"id": 1, "state": "published", "job": "mm", "source_path": "/c/step_1",
                 "local_path": "/e/step_1", "published_at": now, "commit_to_replica_s": 1.5,
                 "phases": {"after_commit": {"sending": 1.2, "publishing": 0.3}, "dominant": "sending"}},
            ],
        });
        let s = render_status("https://e:7071", &sink, now);
        assert!(
            s.contains("(longest phase: sending 1.20 s; ferry status --slow)"),
            "{s}"
        );
        assert!(s.contains("replicas: 1 receiving, 1 published"), "{s}");
        assert!(s.contains("25.0") && s.contains("/c/step_2"), "{s}");
        assert!(
            s.contains("/c/step_1 -> /e/step_1") && s.contains("1.50 s after its commit"),
            "{s}"
        );
        let mut remote = sink.clone();
        remote["replicas"][1]["url"] = json!("hdfs://nn:8020/eval/step_1");
        let s = render_status("https://e:7071", &remote, now);
        assert!(s.contains("/c/step_1 -> hdfs://nn:8020/eval/step_1"), "{s}");
    }

    /// Regression: a checkpoint streamed while it is written showed "0 B /
    /// 0 B -" (the catalog's size is 0 until the commit), and a receiving
    /// replica that had every byte known so far showed 100 %.
    #[test]
    fn status_shows_sizes_known_so_far_while_a_checkpoint_is_written() {
        let now = 1_700_000_000_000;
        let row = |id: i64, checkpoint: &str, state: &str, total: u64, done: u64, p: Value| {
            json!({"id": id, "state": state, "class": "scheduled", "job": "mm",
                   "source_path": format!("/c/step_{id}"), "checkpoint": checkpoint,
                   "bytes_total": total, "bytes_done": done, "progress": p})
        };
        let out = json!({
            "healthz": {"agent": "a", "roles": ["source"]},
            "links": [],
            "transfers": [
                row(1, "open", "active", 0, 0,
                    json!({"bytes_total": 5 << 20, "bytes_sent": 2 << 20, "bytes_skipped": 0})),
                // Paused: no live progress, the catalog holds what it did.
                row(2, "open", "paused", 5 << 20, 3 << 20, Value::Null),
                row(3, "announced", "queued", 8 << 20, 0, Value::Null),
                // A committed checkpoint's size is final: a percentage.
                row(4, "committed", "active", 4 << 20, 1 << 20,
                    json!({"bytes_total": 4 << 20, "bytes_sent": 0, "bytes_skipped": 0})),
                // Resent bytes never count past the total.
                row(5, "committed", "active", 4 << 20, 0,
                    json!({"bytes_total": 4 << 20, "bytes_sent": 3 << 20, "bytes_skipped": 2 << 20})),
            ],
        });
        let s = render_status("http://x", &out, now);
        let line = |path: &str| s.lines().find(|l| l.ends_with(path)).unwrap().to_string();
        for (path, amount) in [
            ("/c/step_1", "2.00 MiB / ≥ 5.00 MiB"),
            ("/c/step_2", "3.00 MiB / ≥ 5.00 MiB"),
            ("/c/step_3", "0 B / ≥ 8.00 MiB"),
            ("/c/step_4", "1.00 MiB / 4.00 MiB"),
            ("/c/step_5", "4.00 MiB / 4.00 MiB"),
        ] {
            let l = line(path);
            assert!(l.contains(amount), "{l:?} lacks {amount:?}\n{s}");
        }
        for path in ["/c/step_1", "/c/step_2", "/c/step_3"] {
            let l = line(path);
            assert!(!l.contains('%') && l.contains(" - "), "{l:?}");
        }
        assert!(line("/c/step_4").contains("25.0"), "{s}");
        assert!(line("/c/step_5").contains("100.0"), "{s}");

        let sink = json!({
            "healthz": {"agent": "e", "roles": ["sink"]},
            "replicas": [
                {"id": 2, "state": "receiving", "job": "mm", "source_path": "/c/open",
                 "bytes_total": 300, "bytes_done": 300},
                {"id": 1, "state": "receiving", "job": "mm", "source_path": "/c/half",
                 "bytes_total": 200, "bytes_done": 50},
            ],
        });
        let s = render_status("http://e", &sink, now);
        let l = s.lines().find(|l| l.ends_with("/c/open")).unwrap();
        assert!(l.contains("300 B / ≥ 300 B") && !l.contains("100.0"), "{s}");
        let l = s.lines().find(|l| l.ends_with("/c/half")).unwrap();
        assert!(l.contains("50 B / 200 B") && l.contains("25.0"), "{s}");
    }

    #[test]
    fn resolution_and_signal_outcomes_read_well() {
        let r =
            json!({"state": "replicating", "bytes_done": 512, "bytes_total": 1024, "eta_s": 3.2});
        let s = describe_resolution("/c/x", &r);
        assert!(
            s.contains("replicating") && s.contains("50.0 %") && s.contains("3 s"),
            "{s}"
        );
        let s = describe_resolution("/c/x", &json!({"state": "unknown"}));
        assert!(s.contains("not heard of /c/x"), "{s}");
        let out = json!({
            "signal": {"id": 4, "job": "mm", "kind": "loss_spike", "severity": 0.8, "step": 1000},
            "new": true, "promoted": 12, "urgent_until": 1_700_000_000_000i64,
            "promoted_state": "active",
        });
        let s = render_signal(&out);
        assert!(
            s.contains("signal 4 stored: loss_spike for job mm, severity 0.8 at step 1000"),
            "{s}"
        );
        assert!(
            s.contains("transfer 12 (active) is urgent until 2023-11-14T22:13:20Z"),
            "{s}"
        );
        let again = json!({"signal": {"id": 4}, "new": false, "promoted": null});
        let s = render_signal(&again);
        assert!(
            s.contains("seen before") && s.contains("no unpublished checkpoint"),
            "{s}"
        );
    }
}
