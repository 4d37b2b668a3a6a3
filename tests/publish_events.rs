//! Publish events on real agents: `GET /v1/replicas/events` announces a
//! publish, the version a re-save replaces and a removal, in order; a
//! client that disconnects between publishes and reconnects with
//! `Last-Event-ID` gets every event it missed; and a webhook whose
//! receiver is down does not hold a publish back: the event and the
//! replica exist while the delivery is retried, and the receiver, once
//! up, gets it, signed.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::time::{Duration, Instant};

use common::*;
use reqwest::StatusCode;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `(id, kind, data)` of server-sent events.
type Ev = (i64, String, Value);

/// Reads `n` events from `GET {url}/v1/replicas/events` (with
/// `Last-Event-ID: last` when given) within `within`; then disconnects.
async fn events(url: &str, token: &str, last: Option<i64>, n: usize, within: Duration) -> Vec<Ev> {
    let mut rb = reqwest::Client::new()
        .get(format!("{url}/v1/replicas/events"))
        .bearer_auth(token);
    if let Some(l) = last {
        rb = rb.header("Last-Event-ID", l.to_string());
    }
    let mut resp = rb.send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let deadline = Instant::now() + within;
    let (mut buf, mut out) = (String::new(), Vec::new());
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(Ok(Some(chunk))) = tokio::time::timeout(left, resp.chunk()).await else {
            panic!("{} of {n} events within {within:?}: {out:?}", out.len());
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let (mut id, mut kind, mut data) = (None, String::new(), String::new());
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("id:") {
                    id = v.trim().parse().ok();
                } else if let Some(v) = line.strip_prefix("event:") {
                    kind = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim());
                }
            }
            if let Some(id) = id {
                out.push((id, kind, serde_json::from_str(&data).unwrap()));
            }
        }
    }
    out
}

/// Accepts one HTTP request on `listener`, answers 200, returns its head
/// and body.
async fn receive(listener: &tokio::net::TcpListener) -> (String, Vec<u8>) {
    let (mut s, _) = listener.accept().await.unwrap();
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    loop {
        let n = s.read(&mut tmp).await.unwrap();
        assert!(n > 0, "connection closed before a whole request");
        buf.extend_from_slice(&tmp[..n]);
        if let Some(h) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..h]).to_string();
            let len: usize = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse().ok())?
                })
                .unwrap_or(0);
            if buf.len() >= h + 4 + len {
                let body = buf[h + 4..h + 4 + len].to_vec();
                s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await
                    .unwrap();
                return (head, body);
            }
        }
    }
}

fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

#[tokio::test]
async fn publish_events_stream_resume_and_reach_a_webhook_that_was_down() {
    let w = World::new("publish-events").await;
    let reader = w.token_new("reader", "evals").await;
    let operator = w.token_new("operator", "ops").await;
    let entries = format!("{}{}", reader.entry, operator.entry);
    // A webhook on a port nothing listens on yet.
    let hook_port = free_tcp_port();
    let secret = w.root.join("hook.secret");
    std::fs::write(&secret, "s3cret\n").unwrap();
    let c = w
        .start_cluster("200Mbit/s", &[], |sink, _| {
            sink.api = entries.clone();
            sink.sink.as_mut().unwrap().extra = format!(
                "[[sink.webhooks]]\nurl = \"http://127.0.0.1:{hook_port}/hook\"\njob = \"*\"\n\
                 secret_file = {}\n",
                toml_str(secret.to_str().unwrap())
            );
        })
        .await;
    let url = c.sink.url();
    let ckpt = |s: u32| w.source_root().join(format!("step_{s:06}"));
    let push = async |s: u32| {
        let out = w.push(&c.source, &ckpt(s), &[]).await;
        w.ensure(out.success(), || format!("ferry push: {out}"));
    };

    w.gen(&ckpt(100), "500KB").await;
    push(100).await;
    // The publish is there at once, whatever the webhook does.
    let first = events(&url, &reader.token, Some(0), 1, Duration::from_secs(30)).await;
    assert_eq!(first[0].1, "published", "{first:?}");
    assert_eq!(first[0].2["rel"], "step_000100");
    let a = first[0].2["replica"].as_i64().unwrap();
    let loc = first[0].2["location"].as_str().unwrap().to_string();
    assert!(std::path::Path::new(&loc).is_dir(), "{loc}");

    // Disconnected: a re-save of step 100 and a new step 200 are published.
    std::fs::write(ckpt(100).join("extra.bin"), b"a re-save").unwrap();
    push(100).await;
    w.gen(&ckpt(200), "500KB").await;
    push(200).await;
    // Back with Last-Event-ID: both publishes and the replacement, in order.
    let missed = events(
        &url,
        &reader.token,
        Some(first[0].0),
        3,
        Duration::from_secs(30),
    )
    .await;
    let kinds: Vec<(&str, &str)> = missed
        .iter()
        .map(|e| (e.1.as_str(), e.2["rel"].as_str().unwrap()))
        .collect();
    assert_eq!(
        kinds,
        vec![
            ("published", "step_000100"),
            ("replaced", "step_000100"),
            ("published", "step_000200")
        ],
        "{missed:?}"
    );
    assert_eq!(missed[1].2["replica"], a);
    assert_eq!(missed[1].2["replaced_by"], missed[0].2["replica"]);
    assert!(missed.windows(2).all(|p| p[0].0 < p[1].0));

    // A removal by hand is the next event.
    let b = missed[2].2["replica"].as_i64().unwrap();
    let r = reqwest::Client::new()
        .delete(format!("{url}/v1/replicas/{b}"))
        .bearer_auth(&operator.token)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let removed = events(
        &url,
        &reader.token,
        Some(missed[2].0),
        1,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        (removed[0].1.as_str(), removed[0].2["replica"].as_i64()),
        ("removed", Some(b))
    );

    // The webhook was down all along; now it comes up and gets the events
    // from the first on, each signed.
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", hook_port))
        .await
        .unwrap();
    let (head, body) = tokio::time::timeout(Duration::from_secs(90), receive(&listener))
        .await
        .unwrap_or_else(|_| w.fail("the webhook was not retried within 90 s"));
    assert!(head.starts_with("POST /hook "), "{head}");
    let got: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(got["id"], first[0].0, "{got}");
    assert_eq!(header(&head, "ferry-event"), Some("published"), "{head}");
    assert_eq!(
        header(&head, "ferry-signature").map(str::to_string),
        Some(ferry::webhooks::signature(b"s3cret", &body)),
        "{head}"
    );
    // The rest follow in order.
    let (_, body2) = tokio::time::timeout(Duration::from_secs(30), receive(&listener))
        .await
        .unwrap_or_else(|_| w.fail("the second webhook delivery"));
    let got2: Value = serde_json::from_slice(&body2).unwrap();
    assert_eq!(got2["id"], missed[0].0, "{got2}");
}
