//! The storage servers' addresses as `ops/with-test-servers` passes them
//! to the storage benchmarks (`ops/bench/listing`, `ops/bench/publish`).

use anyhow::{Context, Result};
use replicator::storage::s3::S3Config;

/// The variable `var`, or an error saying to run through `script`, which
/// starts the servers.
///
/// # Errors
/// `var` is not set.
pub fn env(var: &str, script: &str) -> Result<String> {
    std::env::var(var).with_context(|| {
        format!("{var} is not set: run this through {script}, which starts the servers")
    })
}

/// The S3 test server's bucket and its endpoint and key pair, from
/// FERRY_TEST_S3_URL (`ENDPOINT/BUCKET`), FERRY_TEST_S3_ACCESS_KEY_ID and
/// FERRY_TEST_S3_SECRET_ACCESS_KEY.
///
/// # Errors
/// A variable is not set, or the URL has no `/BUCKET`.
pub fn s3(script: &str) -> Result<(String, S3Config)> {
    let url = env("FERRY_TEST_S3_URL", script)?;
    let (endpoint, bucket) = url
        .rsplit_once('/')
        .context("FERRY_TEST_S3_URL is not ENDPOINT/BUCKET")?;
    let cfg = S3Config {
        endpoint: Some(endpoint.to_string()),
        region: None,
        access_key_id: Some(env("FERRY_TEST_S3_ACCESS_KEY_ID", script)?),
        secret_access_key: Some(env("FERRY_TEST_S3_SECRET_ACCESS_KEY", script)?),
        capacity: None,
    };
    Ok((bucket.to_string(), cfg))
}
