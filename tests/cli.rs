//! The API's CLI clients against real agents: `ferry status`, `ferry
//! resolve`, `ferry signal` and `ferry push` with role tokens (success,
//! 401 without a token, 403 with a token whose role is too low), and
//! `ferry status` against an agent serving HTTPS (`[api] tls_cert`); a
//! closed stdout ends a command quietly.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::*;

/// Bound for one CLI command.
const CMD: Duration = Duration::from_secs(60);

/// Fails unless no output of `out` shows any of `tokens`.
fn no_token_shown(w: &World, out: &CmdOutput, tokens: &[&Token]) {
    for t in tokens {
        w.ensure(!out.all().contains(&t.token), || {
            format!("a token was printed: {out}")
        });
    }
}

#[tokio::test]
async fn cli_clients_use_role_tokens() {
    let w = World::new("cli-tokens").await;
    let reader = w.token_new("reader", "eval-cluster").await;
    let signaler = w.token_new("signaler", "trainer").await;
    let operator = w.token_new("operator", "ops").await;
    let entries = format!("{}{}{}", reader.entry, signaler.entry, operator.entry);
    let all = [&reader, &signaler, &operator];

    // A sink and a source, both requiring tokens, behind a relay.
    let sink_cfg = w.sink_config();
    let sink_toml = toml_with_api(&sink_cfg, &entries);
    let sink_health = format!("http://127.0.0.1:{}/healthz", sink_cfg.api_port);
    let sink = w
        .start_agent_toml("sink", sink_cfg, &sink_toml, &sink_health, w.http())
        .await;
    let relay = w.start_relay(&sink.cfg.quic_listen, "200Mbit/s").await;
    let src_cfg = w.source_config(&format!("127.0.0.1:{}", relay.port), "200Mbit/s");
    let src_toml = toml_with_api(&src_cfg, &entries);
    let src_health = format!("http://127.0.0.1:{}/healthz", src_cfg.api_port);
    let source = w
        .start_agent_toml("source", src_cfg, &src_toml, &src_health, w.http())
        .await;
    let (src, snk) = (source.url(), sink.url());
    let with = |t: &Token| vec![("FERRY_TOKEN", t.token.clone())];
    let run = async |args: &[&str], env: Vec<(&str, String)>| {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let out = w.ferry(args, &env, CMD).await;
        no_token_shown(&w, &out, &all);
        out
    };

    // status: 401 without a token, with a hint; the reader sees the queue.
    let out = run(&["status", "--server", &src], vec![]).await;
    w.ensure(out.code == Some(1), || {
        format!("status without a token: {out}")
    });
    w.ensure(
        out.stderr.contains("401") && out.stderr.contains("--token or FERRY_TOKEN"),
        || format!("status without a token should say 401 and how to fix it: {out}"),
    );
    let out = run(&["status", "--server", &src], with(&reader)).await;
    w.ensure(out.success(), || {
        format!("status with a reader token: {out}")
    });
    w.ensure(
        out.stdout.contains("agent train-a-1 (source)")
            && out.stdout.contains("link to-eval: rate cap 200Mbit/s")
            && out.stdout.contains("transfers: none"),
        || format!("status of an idle source: {out}"),
    );

    // push needs an operator: 403 for the reader, then the operator's
    // push (flag, not environment) replicates.
    let ckpt = w.source_root().join("step_000100");
    w.gen(&ckpt, "3MB").await;
    let path = ckpt.to_str().unwrap();
    let out = run(&["push", path, "--server", &src], with(&reader)).await;
    w.ensure(
        out.code == Some(1) && out.stderr.contains("403") && out.stderr.contains("operator"),
        || format!("push with a reader token should be 403: {out}"),
    );
    let out = run(
        &["push", path, "--server", &src, "--token", &operator.token],
        vec![],
    )
    .await;
    w.ensure(out.success(), || {
        format!("push with an operator token: {out}")
    });
    let replica = w.replica_path("step_000100");
    w.assert_same_tree(&ckpt, &replica);

    let out = run(&["status", "--server", &src], with(&reader)).await;
    w.ensure(
        out.success()
            && out.stdout.contains("transfers: 1 published")
            && out
                .stdout
                .contains(&format!("{path} -> {}", replica.display())),
        || format!("status after the push: {out}"),
    );
    let out = run(&["status", "--server", &src, "--json"], with(&reader)).await;
    let v: serde_json::Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| w.fail(format!("status --json is not JSON ({e}): {out}")));
    w.ensure(
        v["transfers"].as_array().map(Vec::len) == Some(1) && v["healthz"]["agent"] == "train-a-1",
        || format!("status --json: {v}"),
    );
    let out = run(&["status", "--server", &snk], with(&reader)).await;
    w.ensure(
        out.success() && out.stdout.contains("(sink)") && out.stdout.contains("1 published"),
        || format!("status of the sink: {out}"),
    );

    // resolve: the local path (exit 0), exit 3 when not local, 401
    // without a token.
    let out = run(
        &["resolve", path, "--server", &snk, "--wait", "10s"],
        with(&reader),
    )
    .await;
    w.ensure(
        out.success() && out.stdout.trim() == replica.to_str().unwrap(),
        || format!("resolve should print {}: {out}", replica.display()),
    );
    let other = w.source_root().join("step_000200");
    let other = other.to_str().unwrap();
    let out = run(&["resolve", other, "--server", &snk], with(&reader)).await;
    w.ensure(
        out.code == Some(3) && out.stdout.is_empty() && out.stderr.contains("unknown"),
        || format!("resolve of an unknown path should exit 3: {out}"),
    );
    let out = run(
        &["resolve", other, "--server", &snk, "--json"],
        with(&reader),
    )
    .await;
    w.ensure(
        out.code == Some(3) && out.stdout.contains("\"state\":\"unknown\""),
        || format!("resolve --json of an unknown path: {out}"),
    );
    let out = run(&["resolve", path, "--server", &snk], vec![]).await;
    w.ensure(
        out.code == Some(1)
            && out.stderr.contains("401")
            && out.stderr.contains("--token or FERRY_TOKEN"),
        || format!("resolve without a token: {out}"),
    );
    let out = run(
        &["resolve", path, "--server", &snk, "--token", "ferry_wrong"],
        vec![],
    )
    .await;
    w.ensure(
        out.code == Some(1) && out.stderr.contains("401") && out.stderr.contains("unknown"),
        || format!("resolve with an unknown token: {out}"),
    );

    // signal: 403 for a reader, stored for a signaler.
    let signal = [
        "signal",
        "--job",
        JOB,
        "--kind",
        "loss_spike",
        "--severity",
        "0.8",
        "--step",
        "100",
        "--server",
        &src,
    ];
    let out = run(&signal, with(&reader)).await;
    w.ensure(
        out.code == Some(1)
            && out.stderr.contains("403")
            && out.stderr.contains("eval-cluster")
            && out.stderr.contains("signaler"),
        || format!("signal with a reader token should be 403 naming the roles: {out}"),
    );
    let out = run(&signal, vec![]).await;
    w.ensure(out.code == Some(1) && out.stderr.contains("401"), || {
        format!("signal without a token: {out}")
    });
    let out = run(&signal, with(&signaler)).await;
    w.ensure(
        out.success()
            && out.stdout.contains(&format!(
                "stored: loss_spike for job {JOB}, severity 0.8 at step 100"
            ))
            && out.stdout.contains("no unpublished checkpoint"),
        || format!("signal with a signaler token: {out}"),
    );
    let out = run(
        &[
            "signal",
            "--job",
            "nope",
            "--kind",
            "loss_spike",
            "--severity",
            "0.5",
            "--server",
            &src,
        ],
        with(&operator),
    )
    .await;
    w.ensure(
        out.code == Some(1) && out.stderr.contains("404") && out.stderr.contains("nope"),
        || format!("signal for an unknown job: {out}"),
    );

    // The agents never log a token.
    for a in [&source, &sink] {
        let log = a.stderr();
        for t in all {
            w.ensure(!log.contains(&t.token), || {
                format!("{} logged a token", a.label)
            });
        }
    }
}

#[tokio::test]
async fn https_api_needs_its_ca_and_refuses_plain_http() {
    let w = World::new("cli-https").await;
    // The dev CA (reused) signs an API certificate for the sink.
    let out = w
        .ferry(
            &[
                "certs",
                "init",
                "--out",
                w.root.join("certs").to_str().unwrap(),
                "--agent",
                SINK_NAME,
                "--api-host",
                "localhost",
                "--api-host",
                "127.0.0.1",
            ],
            &[],
            CMD,
        )
        .await;
    w.ensure(out.success(), || format!("certs init --api-host: {out}"));
    let certs = w.root.join("certs");
    let ca = certs.join("ca.pem");
    let reader = w.token_new("reader", "eval").await;

    let cfg = w.sink_config();
    let port = cfg.api_port;
    // Relative paths: resolved against the config file's directory.
    fs_link(&certs, &w.root.join("sink").join("certs"));
    let api = format!(
        "tls_cert = \"certs/{SINK_NAME}-api.pem\"\ntls_key = \"certs/{SINK_NAME}-api.key\"\n{}",
        reader.entry
    );
    let toml = toml_with_api(&cfg, &api);
    let trusting = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&std::fs::read(&ca).unwrap()).unwrap())
        .timeout(Duration::from_secs(15))
        .build()
        .unwrap();
    let https = format!("https://127.0.0.1:{port}");
    let sink = w
        .start_agent_toml("sink", cfg, &toml, &format!("{https}/healthz"), &trusting)
        .await;
    w.ensure(
        sink.stderr().contains(&format!("{https} (HTTPS only)")),
        || format!("the agent should log its https URL: {}", sink.stderr()),
    );

    let env = [("FERRY_TOKEN", reader.token.as_str())];
    let ca_s = ca.to_str().unwrap();
    for server in [https.clone(), format!("https://localhost:{port}")] {
        let out = w
            .ferry(
                &["status", "--server", &server, "--ca-cert", ca_s],
                &env,
                CMD,
            )
            .await;
        w.ensure(
            out.success()
                && out
                    .stdout
                    .contains(&format!("agent {SINK_NAME} (sink) at {server}")),
            || format!("status over HTTPS with --ca-cert: {out}"),
        );
    }
    // FERRY_CA_CERT works like --ca-cert.
    let out = w
        .ferry(
            &["status", "--server", &https],
            &[("FERRY_TOKEN", &reader.token), ("FERRY_CA_CERT", ca_s)],
            CMD,
        )
        .await;
    w.ensure(out.success(), || {
        format!("status with FERRY_CA_CERT: {out}")
    });
    // Without the CA: refused, with a hint naming --ca-cert.
    let out = w.ferry(&["status", "--server", &https], &env, CMD).await;
    w.ensure(
        out.code == Some(1) && out.stderr.contains("--ca-cert"),
        || format!("status over HTTPS without the CA should fail naming --ca-cert: {out}"),
    );
    // Plain HTTP to the HTTPS port: no answer, and a hint.
    let out = w
        .ferry(
            &["status", "--server", &format!("http://127.0.0.1:{port}")],
            &env,
            CMD,
        )
        .await;
    w.ensure(
        out.code == Some(1) && out.stderr.contains("cannot reach the agent"),
        || format!("plain http:// to an HTTPS agent must fail: {out}"),
    );
    w.ensure(!out.all().contains(&reader.token), || {
        format!("a token was printed: {out}")
    });
    let plain = w
        .http()
        .get(format!("http://127.0.0.1:{port}/healthz"))
        .send()
        .await;
    w.ensure(plain.is_err(), || {
        format!("the agent answered plain HTTP: {plain:?}")
    });

    // A non-loopback listen without TLS is refused at start, naming the key.
    let mut open = w.sink_config();
    open.data_dir = w.root.join("open").join("data");
    let toml = open
        .to_toml()
        .replace(&format!("127.0.0.1:{}", open.api_port), "0.0.0.0:7070");
    let cfg_path = w.root.join("open.toml");
    std::fs::write(&cfg_path, toml).unwrap();
    let out = w
        .ferry(&["serve", "--config", cfg_path.to_str().unwrap()], &[], CMD)
        .await;
    w.ensure(
        out.code == Some(1)
            && out.stderr.contains("api.listen")
            && out.stderr.contains("allow_plaintext"),
        || format!("serve with a plain non-loopback API must be refused: {out}"),
    );
}

/// Runs `ferry ARGS` with a stdout whose reader is already gone (as after
/// `| head -1` read its line): the exit status and stderr.
fn ferry_into_closed_pipe(args: &[&str]) -> (std::process::ExitStatus, String) {
    let (read, write) = nix::unistd::pipe().unwrap();
    drop(read);
    let out = std::process::Command::new(FERRY)
        .args(args)
        .env_remove("FERRY_CONFIG")
        .env_remove("FERRY_SERVER")
        .env_remove("FERRY_TOKEN")
        .env_remove("FERRY_LOG")
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::from(write))
        .stderr(std::process::Stdio::piped())
        .output()
        .unwrap();
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Regression: `ferry status --json | head -1` panicked ("failed printing
/// to stdout: Broken pipe"); and `ferry serve` named its role `(Sink)`.
#[tokio::test]
async fn closed_stdout_ends_commands_quietly() {
    let w = World::new("cli-pipe").await;
    let sink = w.start_agent("sink", w.sink_config(), &[]).await;
    let url = sink.url();
    for args in [
        vec!["status", "--json", "--server", &url],
        vec!["status", "--server", &url],
        vec!["resolve", "/ckpt/step_1", "--json", "--server", &url],
        vec!["token", "new", "--role", "reader"],
    ] {
        let (status, stderr) = ferry_into_closed_pipe(&args);
        w.ensure(
            status.code() == Some(141) && stderr.trim().is_empty(),
            || {
                format!(
                    "`ferry {}` into a closed pipe: {status}, stderr: {stderr}",
                    args.join(" ")
                )
            },
        );
    }
    let banner =
        std::fs::read_to_string(sink.config_path.parent().unwrap().join("stdout.log")).unwrap();
    w.ensure(banner.contains("(sink) serving"), || {
        format!("serve's banner: {banner}")
    });
}

/// Makes `link` a symbolic link to `target`.
fn fs_link(target: &std::path::Path, link: &std::path::Path) {
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    std::os::unix::fs::symlink(target, link).unwrap();
}
