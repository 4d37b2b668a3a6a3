//! The ops web UI in a real browser: headless Chromium driven through
//! chromedriver (WebDriver) opens the source agent's UI while a transfer
//! runs behind a slow emulated link, watches its progress bar advance with
//! a reader token (no actions offered), pauses the transfer with an
//! operator token and sees the state change, in the page and in the API.
//!
//! Needs the Debian packages `chromium` and `chromium-driver` (`ops/test`
//! installs them); `CHROMEDRIVER` and `CHROMIUM` override the paths.
//! Screenshots go to `<target>/tmp/browser/`.

#![allow(clippy::unwrap_used)]

// Shared with tests/e2e.rs, which uses the rest of it.
#[allow(dead_code)]
mod common;

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{json, Value};

/// Bound for every wait on the page.
const PAGE_WAIT: Duration = Duration::from_secs(60);

fn tool(var: &str, default: &str) -> PathBuf {
    let p = std::env::var_os(var).map_or_else(|| PathBuf::from(default), PathBuf::from);
    assert!(
        p.exists(),
        "{} not found: install the Debian packages chromium and chromium-driver \
         (ops/test does) or set {var}",
        p.display()
    );
    p
}

/// chromedriver on a free port, killed on drop.
struct Driver {
    _proc: Proc,
    url: String,
}

async fn start_driver(w: &World) -> Driver {
    let bin = tool("CHROMEDRIVER", "/usr/bin/chromedriver");
    let port = free_tcp_port();
    let log = std::fs::File::create(w.root.join("chromedriver.log")).unwrap();
    let child = Command::new(bin)
        .arg(format!("--port={port}"))
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    let proc = Proc::new(child);
    let url = format!("http://127.0.0.1:{port}");
    let status = format!("{url}/status");
    w.wait_until("chromedriver to listen", PAGE_WAIT, async || {
        reqwest::get(&status)
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
    .await;
    Driver { _proc: proc, url }
}

async fn browser(w: &World, d: &Driver) -> Client {
    let chromium = tool("CHROMIUM", "/usr/bin/chromium");
    let profile = w.root.join("chromium-profile");
    let caps = json!({
        "goog:chromeOptions": {
            "binary": chromium,
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--window-size=1500,1000",
                format!("--user-data-dir={}", profile.display()),
            ]
        }
    });
    let caps = caps.as_object().unwrap().clone();
    // Only plain HTTP to chromedriver, but the client wants a provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    ClientBuilder::rustls()
        .unwrap()
        .capabilities(caps)
        .connect(&d.url)
        .await
        .unwrap_or_else(|e| w.fail(format!("chromedriver refused a session: {e}")))
}

/// Waits until `f` returns `Some`, re-evaluating every 200 ms.
async fn until<T>(
    w: &World,
    what: &str,
    mut f: impl AsyncFnMut() -> Result<Option<T>, String>,
) -> T {
    let start = Instant::now();
    let mut last = String::new();
    while start.elapsed() < PAGE_WAIT {
        match f().await {
            Ok(Some(v)) => return v,
            Ok(None) => {}
            Err(e) => last = e,
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    w.fail(format!("timed out waiting for {what} (last: {last})"))
}

async fn js(c: &Client, script: &str) -> Result<Value, String> {
    c.execute(script, vec![]).await.map_err(|e| e.to_string())
}

async fn use_token(c: &Client, token: &str) {
    let input = c.find(Locator::Css("#token")).await.unwrap();
    input.send_keys(token).await.unwrap();
    c.find(Locator::Css("#token-use"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

/// The bytes the page's progress bar of transfer `id` shows as done.
async fn progress(c: &Client, id: i64) -> Result<Option<f64>, String> {
    let v = js(
        c,
        &format!(
            "const p = document.querySelector('tr[data-id=\"{id}\"] progress'); \
             return p ? p.value : null;"
        ),
    )
    .await?;
    Ok(v.as_f64())
}

async fn screenshot(c: &Client, name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("browser");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, c.screenshot().await.unwrap()).unwrap();
    eprintln!("screenshot: {}", path.display());
    path
}

#[tokio::test]
async fn the_ui_shows_a_transfer_advance_and_an_operator_pauses_it() {
    let w = World::new("browser").await;
    let ckpt = w.source_root().join("step_000200");
    w.gen(&ckpt, "80MB").await;
    let reader = api::auth::new_token();
    let operator = api::auth::new_token();
    let tokens = format!(
        "[[api.tokens]]\nname = \"eval-dashboard\"\nrole = \"reader\"\nhash = \"{}\"\n\n\
         [[api.tokens]]\nname = \"ops\"\nrole = \"operator\"\nhash = \"{}\"\n",
        api::auth::hash_token(&reader),
        api::auth::hash_token(&operator)
    );
    // 80 MB at 20 Mbit/s: about half a minute, long enough to watch.
    let c = w
        .start_cluster("20Mbit/s", &[], |_, src| src.api = tokens.clone())
        .await;
    let http = reqwest::Client::new();
    let url = c.source.url();
    let r = http
        .post(format!("{url}/v1/transfers"))
        .json(&json!({ "path": ckpt }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "the source must want a token");
    let r = http
        .post(format!("{url}/v1/transfers"))
        .bearer_auth(&operator)
        .json(&json!({ "path": ckpt }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let id = r.json::<Value>().await.unwrap()["id"].as_i64().unwrap();

    let d = start_driver(&w).await;
    let b = browser(&w, &d).await;
    b.goto(&format!("{url}/")).await.unwrap();
    // Without a token the page says it needs one.
    until(&w, "the page to ask for a token", async || {
        let t = js(&b, "return document.querySelector('#notice').textContent").await?;
        Ok(t.as_str().filter(|t| t.contains("401")).map(|_| ()))
    })
    .await;

    // A reader sees the transfer move, and no actions.
    use_token(&b, &reader).await;
    let first = until(&w, "a progress bar with bytes done", async || {
        Ok(progress(&b, id).await?.filter(|v| *v > 0.0))
    })
    .await;
    let later = until(&w, "the progress bar to advance", async || {
        Ok(progress(&b, id).await?.filter(|v| *v > first))
    })
    .await;
    let who = js(&b, "return document.querySelector('#whoami').textContent")
        .await
        .unwrap();
    assert!(
        who.as_str().unwrap().contains("reader"),
        "whoami shows {who}"
    );
    let buttons = js(
        &b,
        &format!("return document.querySelectorAll('tr[data-id=\"{id}\"] button').length"),
    )
    .await
    .unwrap();
    assert_eq!(buttons, json!(0), "a reader was offered actions");
    eprintln!("progress bar: {first} then {later} bytes");
    // The settings in use: a single agent's, from its config file; no
    // form (a pool's settings change there, this agent's link caps in the
    // Links panel).
    let settings = until(&w, "the settings panel", async || {
        let v = js(
            &b,
            "const p = document.querySelector('#settings-panel'); \
             if (!p || p.hidden) return null; \
             return { rows: [...document.querySelectorAll('#settings tbody tr')] \
                        .map((tr) => [...tr.children].map((td) => td.textContent)), \
                      note: document.querySelector('#settings-note').textContent, \
                      form_hidden: document.querySelector('#setting-form').hidden };",
        )
        .await?;
        Ok((!v.is_null()).then_some(v))
    })
    .await;
    let rows = settings["rows"].as_array().cloned().unwrap_or_default();
    assert!(
        rows.contains(&json!(["scheduler.max_active", "4", "config file"])),
        "{settings}"
    );
    assert!(
        rows.contains(&json!([
            format!("link.{LINK}.rate"),
            "20.0 Mbit/s",
            "config file"
        ])),
        "{settings}"
    );
    assert!(
        settings["note"]
            .as_str()
            .unwrap_or("")
            .contains("single agent"),
        "{settings}"
    );
    assert_eq!(settings["form_hidden"], json!(true), "{settings}");

    // An operator pauses it.
    use_token(&b, &operator).await;
    let pause = until(&w, "a pause button", async || {
        match b
            .find(Locator::Css(&format!(
                "tr[data-id=\"{id}\"] button[data-action=\"pause\"]"
            )))
            .await
        {
            Ok(e) => Ok(Some(e)),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    // Let a few more events arrive, then keep the picture of a transfer
    // in progress (docs/ui.png is made from it).
    tokio::time::sleep(Duration::from_secs(3)).await;
    screenshot(&b, "ui-transfer.png").await;
    pause.click().await.unwrap();
    let notice = until(&w, "the pause to be confirmed", async || {
        let t = js(&b, "return document.querySelector('#notice').textContent").await?;
        Ok(t.as_str()
            .filter(|t| t.contains(&format!("Paused transfer {id}")))
            .map(str::to_string))
    })
    .await;
    assert!(notice.contains("paused"), "{notice}");
    until(&w, "the row to show paused", async || {
        let s = js(
            &b,
            &format!(
                "const s = document.querySelector('tr[data-id=\"{id}\"] .state'); \
                 return s ? s.dataset.state : null;"
            ),
        )
        .await?;
        Ok((s == json!("paused")).then_some(()))
    })
    .await;
    // The page now offers resume, and the agent agrees.
    b.find(Locator::Css(&format!(
        "tr[data-id=\"{id}\"] button[data-action=\"resume\"]"
    )))
    .await
    .unwrap();
    let t: Value = http
        .get(format!("{url}/v1/transfers/{id}"))
        .bearer_auth(&reader)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(t["state"], "paused", "{t}");
    screenshot(&b, "ui-paused.png").await;
    b.close().await.unwrap();
}

/// The sink's page: the retention panel shows the policy and each
/// version's verdict, and an operator pins a replica from its row.
#[tokio::test]
async fn the_sink_page_shows_retention_and_an_operator_pins_a_replica() {
    let w = World::new("browser-sink").await;
    let operator = api::auth::new_token();
    let tokens = format!(
        "[[api.tokens]]\nname = \"ops\"\nrole = \"operator\"\nhash = \"{}\"\n",
        api::auth::hash_token(&operator)
    );
    let c = w
        .start_cluster("200Mbit/s", &[], |sink, _| {
            sink.api = tokens.clone();
            sink.sink.as_mut().unwrap().extra =
                "[[sink.retention]]\njob = \"*\"\nkeep_last = 5\n".into();
        })
        .await;
    let ckpt = w.source_root().join("step_000100");
    w.gen(&ckpt, "1MB").await;
    let out = w.push(&c.source, &ckpt, &[]).await;
    w.ensure(out.success(), || format!("ferry push: {out}"));
    let d = start_driver(&w).await;
    let b = browser(&w, &d).await;
    b.goto(&format!("{}/", c.sink.url())).await.unwrap();
    use_token(&b, &operator).await;
    let verdict = until(&w, "the retention panel", async || {
        let v = js(
            &b,
            "const p = document.querySelector('#retention-panel'); \
             if (!p || p.hidden) return null; \
             const td = document.querySelector('#retention tbody tr td:nth-child(7)'); \
             return td ? { verdict: td.textContent, \
                           policies: document.querySelector('#retention-policies').textContent } : null;",
        )
        .await?;
        Ok((!v.is_null()).then_some(v))
    })
    .await;
    assert!(
        verdict["verdict"]
            .as_str()
            .unwrap()
            .starts_with("kept: among the newest 5"),
        "{verdict}"
    );
    assert!(
        verdict["policies"]
            .as_str()
            .unwrap()
            .contains("keep_last 5"),
        "{verdict}"
    );
    // The replica's commit-to-replica time is drawn as a bar of its
    // phases, each segment as wide as its share, named in the title.
    let bar = js(
        &b,
        "const bar = document.querySelector('#replicas .phases'); \
         if (!bar) return null; \
         const segs = [...bar.querySelectorAll('i')]; \
         return { title: bar.getAttribute('title'), classes: segs.map(i => i.className), \
                  widths: segs.reduce((a, i) => a + parseFloat(i.style.width), 0) };",
    )
    .await
    .unwrap();
    assert!(!bar.is_null(), "no bar of phases in the replicas table");
    assert!(bar["title"].as_str().unwrap().contains("sending"), "{bar}");
    assert!(
        bar["classes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c == "ph-publishing"),
        "{bar}"
    );
    let total = bar["widths"].as_f64().unwrap();
    assert!(
        (99.0..=101.0).contains(&total),
        "the segments fill the bar: {bar}"
    );
    // Pin from the row (the reason asked for in a dialog).
    js(&b, "window.prompt = () => 'bisecting'; return null;")
        .await
        .unwrap();
    let pin = until(&w, "a pin button", async || {
        match b
            .find(Locator::Css("#replicas button[data-action=\"pin\"]"))
            .await
        {
            Ok(e) => Ok(Some(e)),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
    pin.click().await.unwrap();
    until(&w, "the replica to show pinned", async || {
        let t = js(
            &b,
            "const td = document.querySelector('#replicas tbody tr td:nth-child(4)'); \
             return td ? td.textContent : null;",
        )
        .await?;
        Ok(t.as_str().filter(|t| t.contains("pinned")).map(|_| ()))
    })
    .await;
    let v: Value = reqwest::Client::new()
        .get(format!("{}/v1/replicas", c.sink.url()))
        .bearer_auth(&operator)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let reason = v["items"][0]["pin"]["reason"].as_str().unwrap_or("");
    assert!(reason.starts_with("bisecting"), "{v}");
    screenshot(&b, "ui-sink.png").await;
    b.close().await.unwrap();
}
