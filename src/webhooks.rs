//! Webhooks (`[[sink.webhooks]]`): each publish event
//! ([`ferry_catalog::ReplicaEvent`]) of a matching job is POSTed as JSON
//! to the hook's URL, in order, signed with the hook's shared secret:
//! `Ferry-Signature: sha256=<hex HMAC-SHA256(secret, body)>` (RFC 2104),
//! with `Ferry-Event` (the kind) and `Ferry-Event-Id`. A delivery that
//! fails (no answer, or not 2xx) is retried with backoff (1 s doubling to
//! 60 s) until it succeeds; later events wait behind it. Nothing here can
//! block or fail a publish: the events are already in the catalog, and
//! each hook's position (the last event delivered) is kept there too, so
//! a restart neither loses nor repeats events (a hook seen for the first
//! time starts after the newest event).

use std::time::Duration;

use anyhow::{Context, Result};
use ferry_catalog::ReplicaEvent;
use hmac::{Hmac, Mac};
use replicator::sink::Sink;
use sha2::Sha256;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// One configured hook, ready to run.
#[derive(Clone)]
pub struct Webhook {
    /// Where events are POSTed.
    pub url: String,
    /// Which jobs' events.
    pub jobs: globset::GlobMatcher,
    /// The shared secret (bytes of the secret file, trailing newline
    /// removed).
    pub secret: Vec<u8>,
}

impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhook")
            .field("url", &self.url)
            .field("jobs", &self.jobs.glob().glob())
            .finish_non_exhaustive()
    }
}

/// Longest wait between two tries of one delivery.
const MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Events read from the log at once.
const BATCH: i64 = 64;

/// How long one delivery may take.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);

/// `sha256=<hex>` of `body` under `secret`.
pub fn signature(secret: &[u8], body: &[u8]) -> String {
    // HMAC takes a key of any length.
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret)
        .unwrap_or_else(|_| <Hmac<Sha256> as Mac>::new_from_slice(&[0]).expect("a one-byte key"));
    mac.update(body);
    let out = mac.finalize().into_bytes();
    let mut hex = String::with_capacity(7 + 64);
    hex.push_str("sha256=");
    for b in out {
        hex.push_str(&format!("{b:02x}"));
    }
    hex
}

/// Starts one delivery task per hook; they stop with `stop`.
pub fn spawn(sink: Sink, hooks: Vec<Webhook>, stop: CancellationToken) {
    for h in hooks {
        tokio::spawn(deliver(sink.clone(), h, stop.clone()));
    }
}

async fn deliver(sink: Sink, hook: Webhook, stop: CancellationToken) {
    let http = match reqwest::Client::builder().timeout(DELIVERY_TIMEOUT).build() {
        Ok(c) => c,
        Err(e) => {
            warn!(url = hook.url, "webhook: no HTTP client: {e}");
            return;
        }
    };
    let catalog = sink.catalog().clone();
    let mut changes = sink.changes();
    // Where it stopped, or from now on for a new hook.
    let mut pos = loop {
        let r = match catalog.webhook_position(&hook.url).await {
            Ok(Some(p)) => Ok(p),
            Ok(None) => match catalog.last_replica_event().await {
                Ok(last) => catalog
                    .set_webhook_position(&hook.url, last)
                    .await
                    .map(|()| last),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        match r {
            Ok(p) => break p,
            Err(e) => {
                warn!(url = hook.url, error = %e, "webhook: reading its position in the catalog; trying again in 5 s");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(5)) => {}
                }
            }
        }
    };
    loop {
        let events = match catalog.replica_events_after(pos, BATCH).await {
            Ok(e) => e,
            Err(e) => {
                warn!(url = hook.url, error = %e, "webhook: reading publish events");
                Vec::new()
            }
        };
        if events.is_empty() {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::timeout(Duration::from_secs(1), changes.changed()) => {}
            }
            continue;
        }
        for e in events {
            let e = sink.event_view(e);
            if hook.jobs.is_match(&e.job) && !post_until_delivered(&http, &hook, &e, &stop).await {
                return;
            }
            pos = e.id;
            if let Err(err) = catalog.set_webhook_position(&hook.url, pos).await {
                warn!(url = hook.url, error = %err, "webhook: recording its position");
            }
        }
    }
}

/// POSTs `e` until it is taken (true) or the agent stops (false).
async fn post_until_delivered(
    http: &reqwest::Client,
    hook: &Webhook,
    e: &ReplicaEvent,
    stop: &CancellationToken,
) -> bool {
    let body = match serde_json::to_vec(e) {
        Ok(b) => b,
        Err(err) => {
            warn!(
                url = hook.url,
                event = e.id,
                "webhook: encoding the event: {err}"
            );
            return true;
        }
    };
    let sig = signature(&hook.secret, &body);
    let mut backoff = Duration::from_secs(1);
    let mut failing_since: Option<std::time::Instant> = None;
    loop {
        let r = http
            .post(&hook.url)
            .header("content-type", "application/json")
            .header("ferry-event", e.kind.as_str())
            .header("ferry-event-id", e.id.to_string())
            .header("ferry-signature", &sig)
            .body(body.clone())
            .send()
            .await;
        let why = match r {
            Ok(resp) if resp.status().is_success() => {
                if let Some(t) = failing_since {
                    info!(
                        url = hook.url,
                        event = e.id,
                        after_s = t.elapsed().as_secs(),
                        "webhook: delivering again"
                    );
                }
                return true;
            }
            Ok(resp) => format!("answered {}", resp.status()),
            Err(err) => err.to_string(),
        };
        if failing_since.is_none() {
            // Once per outage, not per try.
            warn!(
                url = hook.url,
                event = e.id,
                "webhook: delivery failed ({why}); retrying with backoff up to 60 s, later events wait"
            );
            failing_since = Some(std::time::Instant::now());
        }
        tokio::select! {
            _ = stop.cancelled() => return false,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Reads a hook's secret file: its bytes, a trailing newline removed.
///
/// # Errors
/// The file cannot be read, or is empty.
pub fn read_secret(path: &std::path::Path) -> Result<Vec<u8>> {
    let mut s = std::fs::read(path).with_context(|| format!("secret_file {}", path.display()))?;
    while s.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
        s.pop();
    }
    anyhow::ensure!(!s.is_empty(), "secret_file {} is empty", path.display());
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 4231, test case 2.
    #[test]
    fn the_signature_is_hmac_sha256_in_hex() {
        assert_eq!(
            signature(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
