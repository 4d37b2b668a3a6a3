//! The Python client (`api/clients/python`) against real agents: it is
//! installed with pip into a scratch directory (no network: the build
//! backend is target/py's setuptools and wheel, which ops/test installs),
//! then its tests run against a
//! source and a sink agent started here, with tokens of the roles they
//! need.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::path::Path;
use std::time::Duration;

use common::*;

#[tokio::test]
async fn the_python_client_works_against_real_agents() {
    let w = World::new("python-client").await;
    let reader = w.token_new("reader", "evals").await;
    let operator = w.token_new("operator", "ops").await;
    let entries = format!("{}{}", reader.entry, operator.entry);
    let c = w
        .start_cluster("200Mbit/s", &[], |sink, source| {
            sink.api = entries.clone();
            source.api = entries.clone();
            source.source.as_mut().unwrap().scan_interval = "1s".into();
        })
        .await;
    w.gen(&w.source_root().join("step_000100"), "2MB").await;

    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let client = repo.join("api/clients/python");
    // The test command (ops/test) makes this environment, with
    // setuptools and wheel.
    let python = repo.join("target/py/bin/python");
    assert!(
        python.exists(),
        "{} is missing: run the tests with the test command in README.md (ops/test), which \
         makes it",
        python.display()
    );
    // Installed from a copy: a build writes build/ and *.egg-info beside
    // the sources it builds.
    let copy = w.root.join("py-src");
    copy_tree(&client, &copy);
    let site = w.root.join("py-site");
    let install = tokio::process::Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
        ])
        .arg("--target")
        .arg(&site)
        .arg(&copy)
        .env("PIP_DISABLE_PIP_VERSION_CHECK", "1")
        .output()
        .await
        .expect("running target/py/bin/python -m pip");
    assert!(
        install.status.success(),
        "pip install ./api/clients/python failed:\n{}\n{}",
        String::from_utf8_lossy(&install.stdout),
        String::from_utf8_lossy(&install.stderr)
    );
    let run = tokio::process::Command::new(&python)
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(client.join("tests"))
        // The installed package, not the source tree.
        .current_dir(&w.root)
        .env("PYTHONPATH", &site)
        .env("FERRY_PY_SOURCE", c.source.url())
        .env("FERRY_PY_SINK", c.sink.url())
        .env("FERRY_PY_READER", &reader.token)
        .env("FERRY_PY_OPERATOR", &operator.token)
        .env("FERRY_PY_JOB", JOB)
        .env("FERRY_PY_ROOT", w.source_root())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), run)
        .await
        .unwrap_or_else(|_| w.fail("the Python client's tests ran over 300 s"))
        .unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    w.ensure(out.status.success(), || {
        format!("the Python client's tests failed:\n{text}")
    });
    // Every test ran (none skipped).
    w.ensure(text.contains("Ran 5 tests") && text.contains("OK"), || {
        format!("expected 5 tests to run and pass:\n{text}")
    });
}
