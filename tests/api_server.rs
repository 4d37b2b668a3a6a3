//! The API server protects the agent from slow and idle clients: a
//! request's headers must arrive within the header deadline, and at most
//! `[api] max_connections` connections are open at once (more are closed
//! at once), so they cannot take the file descriptors replication needs.

#![allow(clippy::unwrap_used)]

// Shared with tests/e2e.rs, which uses the rest of it.
#[allow(dead_code)]
mod common;

use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until the server closes the connection or `within` passes;
/// returns what arrived, or `None` if it is still open.
async fn closed_within(s: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let deadline = Instant::now() + within;
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

#[tokio::test]
async fn slow_headers_are_cut_and_connections_are_capped() {
    let w = World::new("api-server").await;
    let mut cfg = w.sink_config();
    cfg.api = format!("{OPEN_API}max_connections = 3\n");
    let sink = w.start_agent("sink", cfg, &[]).await;
    let addr = format!("127.0.0.1:{}", sink.cfg.api_port);

    // Three clients that never finish their headers take every slot.
    let mut slow = Vec::new();
    for _ in 0..3 {
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        slow.push(s);
    }
    // Give the server a moment to accept them.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // A fourth is closed at once, without an answer.
    let mut extra = TcpStream::connect(&addr).await.unwrap();
    let _ = extra
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let got = closed_within(&mut extra, Duration::from_secs(5)).await;
    let got = got.unwrap_or_else(|| w.fail("a connection over max_connections was kept open"));
    assert!(
        got.is_empty(),
        "it was answered: {}",
        String::from_utf8_lossy(&got)
    );

    // The slow ones are closed once the header deadline passes (10 s;
    // bounded at 40 s here, whatever the machine's speed).
    for s in &mut slow {
        let got = closed_within(s, Duration::from_secs(40)).await;
        w.ensure(got.is_some(), || {
            "a client that never finished its headers is still connected after 40 s".into()
        });
    }
    // The slots are free again.
    let v = w.get_json(&format!("{}/healthz", sink.url())).await;
    assert_eq!(v["status"], "ok");
    let log = sink.stderr();
    assert!(
        log.contains("max_connections"),
        "the refusal is not logged:\n{log}"
    );
}
