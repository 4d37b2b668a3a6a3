//! Schema-driven fuzzing of every API operation: schemathesis (from PyPI;
//! `ops/test` installs it into `target/py`) reads each agent's
//! `/openapi.json` and sends generated requests, valid and invalid, with
//! an operator token, to a running source and sink that hold a transfer
//! and a published replica. No answer may be a 5xx, no agent may crash or
//! log a panic. `FERRY_SCHEMATHESIS` overrides the path;
//! `FERRY_FUZZ_EXAMPLES` (default 5 per operation), `FERRY_FUZZ_SECONDS`
//! (default 60 per agent) and `FERRY_FUZZ_SEED` (default 7) size and seed
//! a run.

#![allow(clippy::unwrap_used)]

// Shared with tests/e2e.rs, which uses the rest of it.
#[allow(dead_code)]
mod common;

use std::path::PathBuf;
use std::process::Command;

use common::*;
use serde_json::json;

fn schemathesis() -> PathBuf {
    let p = std::env::var_os("FERRY_SCHEMATHESIS").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/py/bin/schemathesis"),
        PathBuf::from,
    );
    assert!(
        p.exists(),
        "{} not found: ops/test installs schemathesis into target/py \
         (python3 -m venv target/py && target/py/bin/pip install schemathesis), \
         or set FERRY_SCHEMATHESIS",
        p.display()
    );
    p
}

fn env_or(var: &str, default: u32) -> u32 {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test]
async fn every_operation_survives_schema_driven_fuzzing() {
    let bin = schemathesis();
    let w = World::new("api-fuzz").await;
    let ckpt = w.source_root().join("step_000300");
    w.gen(&ckpt, "4MB").await;
    let token = api::auth::new_token();
    let api_lines = format!(
        "allow_unauthenticated = false\n\
         [[api.tokens]]\nname = \"fuzzer\"\nrole = \"operator\"\nhash = \"{}\"\n",
        api::auth::hash_token(&token)
    );
    let c = w
        .start_cluster("200Mbit/s", &[], |sink, src| {
            sink.api = api_lines.clone();
            src.api = api_lines.clone();
        })
        .await;
    // Something to find: a published replica and its transfer.
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{}/v1/transfers", c.source.url()))
        .bearer_auth(&token)
        .json(&json!({ "path": ckpt }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let url = reqwest::Url::parse_with_params(
        &format!("{}/v1/resolve", c.sink.url()),
        &[("path", ckpt.to_str().unwrap()), ("wait", "60s")],
    )
    .unwrap();
    let v: serde_json::Value = http
        .get(url)
        .bearer_auth(&token)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["state"], "local", "{v}");

    let examples = env_or("FERRY_FUZZ_EXAMPLES", 5).to_string();
    let seed = env_or("FERRY_FUZZ_SEED", 7).to_string();
    // Seconds per agent; the run stops there whatever it has covered.
    let budget = env_or("FERRY_FUZZ_SECONDS", 60).to_string();
    for agent in [&c.source, &c.sink] {
        let log = w.root.join(format!("schemathesis-{}.log", agent.label));
        let out = tokio::task::spawn_blocking({
            let (bin, url) = (bin.clone(), format!("{}/openapi.json", agent.url()));
            let (token, examples, seed) = (token.clone(), examples.clone(), seed.clone());
            let (budget, dir) = (budget.clone(), w.root.clone());
            move || {
                Command::new(bin)
                    // Its `.schemathesis/` cache goes to the test's directory,
                    // not the working tree.
                    .current_dir(&dir)
                    .args(["run", &url, "--checks", "not_a_server_error"])
                    .args(["--max-examples", &examples, "--seed", &seed])
                    .args(["--max-time", &budget, "--no-color"])
                    .args(["-H", &format!("Authorization: Bearer {token}")])
                    .output()
                    .unwrap()
            }
        })
        .await
        .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        std::fs::write(&log, &text).unwrap();
        let summary = text
            .lines()
            .find(|l| l.contains(" generated, "))
            .unwrap_or("no summary")
            .trim()
            .to_string();
        eprintln!(
            "schemathesis on the {}: {summary} (seed {seed})",
            agent.label
        );
        w.ensure(out.status.success(), || {
            format!(
                "schemathesis found failures on the {}:\n{text}",
                agent.label
            )
        });
        w.ensure(
            summary.contains("passed") && !summary.contains("failed"),
            || format!("unexpected summary on the {}: {summary}", agent.label),
        );
    }
    // Both agents are still up and nothing panicked.
    for agent in [&c.source, &c.sink] {
        let h = w.get_json(&format!("{}/healthz", agent.url())).await;
        assert_eq!(h["status"], "ok");
        let log = agent.stderr();
        w.ensure(!log.contains("panicked"), || {
            format!("the {} logged a panic:\n{log}", agent.label)
        });
        w.ensure(!log.contains(&token[6..]), || {
            format!("the {} logged the token", agent.label)
        });
    }
}
