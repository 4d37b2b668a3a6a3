//! `ferry replay` as a user runs it: the same trace gives the same output
//! byte for byte (table, JSON and chart), a preset written out and read
//! back replays the same, and bad input is named (the trace's line, the
//! policy file's key).

#![allow(clippy::unwrap_used)]

use std::process::{Command, Output};

const FERRY: &str = env!("CARGO_BIN_EXE_ferry");

fn ferry(args: &[&str]) -> Output {
    Command::new(FERRY)
        .args(args)
        .env_remove("FERRY_CONFIG")
        .output()
        .unwrap()
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "ferry failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn the_same_trace_gives_the_same_output_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_string_lossy().into_owned();
    let args = |svg: &str, trace: &str| {
        vec![
            "replay".to_string(),
            "--preset".into(),
            "seed-208".into(),
            "--hours".into(),
            "2".into(),
            "--seed".into(),
            "5".into(),
            "--svg".into(),
            p(svg),
            "--write-trace".into(),
            p(trace),
        ]
    };
    let run = |a: Vec<String>| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        stdout(&ferry(&a))
    };
    let first = run(args("a.svg", "a.jsonl"));
    let second = run(args("b.svg", "b.jsonl"));
    assert_eq!(first, second);
    for (a, b) in [("a.svg", "b.svg"), ("a.jsonl", "b.jsonl")] {
        let (a, b) = (std::fs::read(p(a)).unwrap(), std::fs::read(p(b)).unwrap());
        assert!(!a.is_empty());
        assert_eq!(a, b);
    }
    let svg = std::fs::read_to_string(p("a.svg")).unwrap();
    assert!(svg.contains("<svg") && svg.contains("fifo") && svg.contains("priority"));
    // Both policies, every class, and the figures asked for.
    for want in [
        "fifo",
        "priority",
        "urgent, time to ready",
        "scheduled, time to ready",
        "background, time to ready",
        "p99",
        "over alone",
    ] {
        assert!(first.contains(want), "{want} missing:\n{first}");
    }

    // The written trace replays like the preset (at the preset's chunk).
    let from_file = stdout(&ferry(&[
        "replay",
        &p("a.jsonl"),
        "--chunk",
        "64MiB",
        "--json",
    ]));
    let from_preset = stdout(&ferry(&[
        "replay", "--preset", "seed-208", "--hours", "2", "--seed", "5", "--json",
    ]));
    let strip = |s: &str| {
        let mut v: serde_json::Value = serde_json::from_str(s).unwrap();
        v["source"] = serde_json::Value::Null;
        v
    };
    assert_eq!(strip(&from_file), strip(&from_preset));
    // Another seed is another day.
    let other = stdout(&ferry(&[
        "replay", "--preset", "seed-208", "--hours", "2", "--seed", "6", "--json",
    ]));
    assert_ne!(strip(&other), strip(&from_preset));
}

#[test]
fn a_policy_file_changes_the_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("no-floors.toml");
    std::fs::write(
        &file,
        "# Background waits while anything else moves.\n[scheduler]\nmax_active = 2\n\n[scheduler.floors]\nbackground = 0.0\nscheduled = 0.0\n",
    )
    .unwrap();
    let file = file.to_string_lossy().into_owned();
    let out = stdout(&ferry(&[
        "replay",
        "--preset",
        "demo-priority",
        "--policy",
        "priority",
        "--policy",
        &file,
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let p = &v["policies"];
    assert_eq!(p[1]["policy"], "no-floors.toml");
    let bg_p50 = |i: usize| {
        p[i]["classes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["class"] == "background")
            .unwrap()["time_to_ready_s"]["p50"]
            .as_f64()
            .unwrap()
    };
    // Two at a time instead of four: the first background copies finish
    // sooner.
    assert!(bg_p50(1) < bg_p50(0), "{out}");
}

/// `ferry replay --preset demo-priority --policy FILE`.
fn with_policy(file: &std::path::Path) -> Output {
    ferry(&[
        "replay",
        "--preset",
        "demo-priority",
        "--policy",
        file.to_str().unwrap(),
    ])
}

#[test]
fn bad_input_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.jsonl");
    std::fs::write(
        &trace,
        "{\"ferry_trace\":1,\"links\":[{\"link\":\"l\",\"rate_bps\":1000,\"rtt_ms\":10}]}\n\
         {\"at_ms\":0,\"event\":\"arrival\",\"id\":1,\"link\":\"l\",\"bytes\":10,\"class\":\"urgent\",\"job\":\"j\"}\n\
         {\"at_ms\":1,\"event\":\"arrival\",\"id\":2,\"link\":\"l\"\n",
    )
    .unwrap();
    let o = ferry(&["replay", trace.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("line 3"), "{err}");

    let policy = dir.path().join("p.toml");
    std::fs::write(&policy, "[scheduler]\nmax_actve = 3\n").unwrap();
    let o = with_policy(&policy);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("max_actve"), "{err}");

    std::fs::write(&policy, "[scheduler]\nmax_active = 0\n").unwrap();
    let o = with_policy(&policy);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("max_active must be from 1 to 64"), "{err}");

    let o = ferry(&["replay", "--preset", "demo-priority", "--policy", "fastest"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("\"fastest\""), "{err}");

    // Checked before anything is written.
    let written = dir.path().join("w.jsonl");
    let o = ferry(&[
        "replay",
        "--preset",
        "demo-priority",
        "--policy",
        "fastest",
        "--write-trace",
        written.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(!written.exists());
    let o = ferry(&[
        "replay",
        "--preset",
        "demo-priority",
        "--svg",
        dir.path().to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("is a directory"));
    // Options that do not apply are refused, not ignored.
    let o = ferry(&["replay", trace.to_str().unwrap(), "--seed", "5"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--preset seed-208 only"));
    let o = ferry(&["replay"]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("--preset"));
    // A trace of no transfers has nothing to replay.
    std::fs::write(&trace, "{\"ferry_trace\":1}\n").unwrap();
    let o = ferry(&["replay", trace.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nothing to replay"));
    // A replay too fine to finish soon asks for a larger chunk.
    std::fs::write(
        &trace,
        "{\"ferry_trace\":1,\"links\":[{\"link\":\"l\",\"rate_bps\":1000,\"rtt_ms\":10}]}\n\
         {\"at_ms\":0,\"event\":\"arrival\",\"id\":1,\"link\":\"l\",\"bytes\":10000000000000000,\"class\":\"urgent\",\"job\":\"j\"}\n",
    )
    .unwrap();
    let o = ferry(&["replay", trace.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("give a larger --chunk"));
}
