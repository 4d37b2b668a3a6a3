//! The HTTP client the CLI's client commands (`status`, `resolve`,
//! `signal`, `push`, `trace`) share: which agent to ask (`--server`), the bearer
//! token (`--token`, never printed or logged) and the CA to trust for an
//! `https://` agent (`--ca-cert`); error answers become one-line messages
//! with a hint.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use reqwest::StatusCode;
use serde_json::Value;

/// Timeout of one request, unless a command asks for longer (resolve's
/// long poll).
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A bearer token: shown as `***` in debug output, never printed.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// Parses a token given on the command line or in `FERRY_TOKEN`
    /// (surrounding white space removed).
    ///
    /// # Errors
    /// An empty token.
    pub fn parse(s: &str) -> Result<Secret, String> {
        let t = s.trim();
        if t.is_empty() {
            return Err("the token is empty".into());
        }
        Ok(Secret(t.to_string()))
    }
}

impl Secret {
    /// Checks the token can be sent as `Authorization: Bearer TOKEN`,
    /// saying what is wrong without showing it (clap's own value errors
    /// would print it, hence not in [`Secret::parse`]).
    ///
    /// # Errors
    /// A token with a control character (a pasted line break, say).
    fn check_header(&self) -> Result<()> {
        if reqwest::header::HeaderValue::from_str(&format!("Bearer {}", self.0)).is_err() {
            bail!(
                "the token (--token or FERRY_TOKEN) is not a valid HTTP header value: it holds \
                 a control character such as a line break; `ferry token new` prints one line \
                 of letters, digits and `_`"
            );
        }
        Ok(())
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Which agent to ask and how: the flags every client command takes.
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    /// The agent's API: http://HOST:PORT (loopback) or https://HOST:PORT.
    #[arg(long, env = "FERRY_SERVER", default_value = "http://127.0.0.1:7070")]
    pub server: String,
    /// Bearer token from `ferry token new` (prefer FERRY_TOKEN: a command
    /// line is visible to other users of the host). Never printed.
    #[arg(long, env = "FERRY_TOKEN", hide_env_values = true, value_parser = Secret::parse)]
    pub token: Option<Secret>,
    /// PEM file of the CA that signed an https:// agent's certificate
    /// (e.g. certs/ca.pem from `ferry certs init`).
    #[arg(long, env = "FERRY_CA_CERT", value_name = "FILE")]
    pub ca_cert: Option<PathBuf>,
}

/// Ends the process with `code` after the command printed what it had to
/// say (main does not print anything more).
#[derive(Debug)]
pub struct Exit(pub i32);

/// An error answer of the agent: its HTTP status, and the message shown
/// (`METHOD PATH: STATUS: {"error"} message`, with a hint for 401 and
/// 403). Callers may downcast an `anyhow::Error` to it to look at the
/// status.
#[derive(Debug)]
pub struct HttpError {
    /// The answer's status.
    pub status: StatusCode,
    text: String,
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::error::Error for HttpError {}

impl std::fmt::Display for Exit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit code {}", self.0)
    }
}

impl std::error::Error for Exit {}

/// A client of one agent's API.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<Secret>,
}

impl Client {
    /// A client of `args.server` whose requests time out after `timeout`.
    ///
    /// # Errors
    /// A server that is not an http:// or https:// URL, a token that cannot
    /// go in an HTTP header, an unreadable or empty `--ca-cert`.
    pub fn new(args: &ServerArgs, timeout: Duration) -> Result<Client> {
        if let Some(t) = &args.token {
            t.check_header()?;
        }
        let base = args.server.trim().trim_end_matches('/').to_string();
        let url = reqwest::Url::parse(&base).map_err(|e| {
            anyhow::anyhow!(
                "--server {base:?} is not a URL ({e}); give http://HOST:PORT or https://HOST:PORT"
            )
        })?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            bail!("--server {base:?} must be http://HOST:PORT or https://HOST:PORT");
        }
        let mut b = reqwest::Client::builder()
            .use_rustls_tls()
            .timeout(timeout)
            .connect_timeout(Duration::from_secs(10));
        if let Some(ca) = &args.ca_cert {
            let pem = std::fs::read(ca).with_context(|| format!("--ca-cert {}", ca.display()))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .with_context(|| format!("--ca-cert {}: not PEM", ca.display()))?;
            if certs.is_empty() {
                bail!("--ca-cert {}: no certificate in it", ca.display());
            }
            for c in certs {
                b = b.add_root_certificate(c);
            }
        }
        Ok(Client {
            http: b.build().context("building the HTTP client")?,
            base,
            token: args.token.clone(),
        })
    }

    /// The agent's base URL, without a trailing slash.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// `GET path?query` as JSON.
    ///
    /// # Errors
    /// See [`Client::send`].
    pub async fn get(&self, path: &str, query: &[(&str, &str)]) -> Result<Value> {
        let rb = self.http.get(format!("{}{path}", self.base)).query(query);
        Ok(self.send(rb, "GET", path).await?.1)
    }

    /// `GET path?query` as text (for answers that are not one JSON
    /// document, such as the JSON lines of `/v1/trace`).
    ///
    /// # Errors
    /// See [`Client::send`].
    pub async fn get_text(&self, path: &str, query: &[(&str, &str)]) -> Result<String> {
        let rb = self.http.get(format!("{}{path}", self.base)).query(query);
        Ok(self.send_text(rb, "GET", path).await?.1)
    }

    /// `POST path` with a JSON body; the status and the JSON answer.
    ///
    /// # Errors
    /// See [`Client::send`].
    pub async fn post(&self, path: &str, body: &Value) -> Result<(StatusCode, Value)> {
        let rb = self.http.post(format!("{}{path}", self.base)).json(body);
        self.send(rb, "POST", path).await
    }

    /// `PUT path` with a JSON body; the status and the JSON answer.
    ///
    /// # Errors
    /// See [`Client::send`].
    pub async fn put(&self, path: &str, body: &Value) -> Result<(StatusCode, Value)> {
        let rb = self.http.put(format!("{}{path}", self.base)).json(body);
        self.send(rb, "PUT", path).await
    }

    /// `DELETE path?query`; the status and the JSON answer.
    ///
    /// # Errors
    /// See [`Client::send`].
    pub async fn delete(&self, path: &str, query: &[(&str, &str)]) -> Result<(StatusCode, Value)> {
        let rb = self
            .http
            .delete(format!("{}{path}", self.base))
            .query(query);
        self.send(rb, "DELETE", path).await
    }

    /// Sends a request with the token and reads a JSON answer.
    ///
    /// # Errors
    /// The agent cannot be reached (with a hint about the scheme or the
    /// CA), or answers an error: its status and `{"error"}` message, with
    /// a hint for 401 and 403; a success that is not JSON.
    async fn send(
        &self,
        rb: reqwest::RequestBuilder,
        method: &str,
        path: &str,
    ) -> Result<(StatusCode, Value)> {
        let (status, text) = self.send_text(rb, method, path).await?;
        let v = serde_json::from_str(&text).with_context(|| {
            format!(
                "{method} {path}: the answer of {} is not JSON: {}",
                self.base,
                excerpt(&text)
            )
        })?;
        Ok((status, v))
    }

    /// Sends a request with the token and reads a successful answer as
    /// text.
    ///
    /// # Errors
    /// The agent cannot be reached (with a hint about the scheme or the
    /// CA), or answers an error: its status and `{"error"}` message, with
    /// a hint for 401 and 403.
    async fn send_text(
        &self,
        mut rb: reqwest::RequestBuilder,
        method: &str,
        path: &str,
    ) -> Result<(StatusCode, String)> {
        if let Some(t) = &self.token {
            rb = rb.bearer_auth(&t.0);
        }
        let resp = match rb.send().await {
            Ok(r) => r,
            Err(e) => bail!("{}", self.unreachable(&e)),
        };
        let status = resp.status();
        let text = resp
            .text()
            .await
            .with_context(|| format!("{method} {path}: reading the answer of {}", self.base))?;
        if status.is_success() {
            return Ok((status, text));
        }
        let json: Option<Value> = serde_json::from_str(&text).ok();
        let message = json
            .as_ref()
            .and_then(|v| v["error"].as_str())
            .map_or_else(|| excerpt(&text), str::to_string);
        Err(HttpError {
            status,
            text: format!("{method} {path}: {status}: {message}{}", self.hint(status)),
        }
        .into())
    }

    fn hint(&self, status: StatusCode) -> String {
        match status {
            StatusCode::UNAUTHORIZED if self.token.is_none() => {
                "\nhint: this agent needs a token: set --token or FERRY_TOKEN (an operator makes one with `ferry token new --role reader|signaler|operator`)".into()
            }
            StatusCode::UNAUTHORIZED => {
                "\nhint: the token given (--token or FERRY_TOKEN) is not in this agent's [[api.tokens]]; check FERRY_SERVER and the token".into()
            }
            StatusCode::FORBIDDEN => {
                "\nhint: ask an operator for a token with the role named above (`ferry token new --role ...`)".into()
            }
            _ => String::new(),
        }
    }

    /// Why the agent could not be reached, with a hint.
    fn unreachable(&self, e: &reqwest::Error) -> String {
        let mut chain = e.to_string();
        let mut src = std::error::Error::source(e);
        while let Some(s) = src {
            chain += &format!(": {s}");
            src = s.source();
        }
        let https = self.base.starts_with("https://");
        let lower = chain.to_lowercase();
        let hint = if e.is_timeout() {
            "the agent did not answer in time".to_string()
        } else if https && (lower.contains("certificate") || lower.contains("unknownissuer")) {
            "the agent's certificate is not trusted or does not name this host: pass --ca-cert (or FERRY_CA_CERT) with the CA that signed it, and use a host name in its SANs".into()
        } else if https && (lower.contains("tls") || lower.contains("handshake")) {
            "is the agent serving HTTPS? Without [api] tls_cert it serves plain http://".into()
        } else if !https
            && (lower.contains("connection closed")
                || lower.contains("reset")
                || lower.contains("invalid http"))
        {
            "is the agent serving HTTPS ([api] tls_cert)? Then use https:// and --ca-cert".into()
        } else if lower.contains("refused") {
            "is the agent running, and is this its [api] listen address?".into()
        } else {
            "check --server (FERRY_SERVER)".into()
        };
        format!(
            "cannot reach the agent at {}: {chain}\nhint: {hint}",
            self.base
        )
    }
}

/// The first 200 characters of an answer, for error messages.
fn excerpt(text: &str) -> String {
    let t: String = text.trim().chars().take(200).collect();
    if t.is_empty() {
        "(empty answer)".into()
    } else {
        t
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn args(token: &str) -> ServerArgs {
        ServerArgs {
            server: "http://127.0.0.1:7070".into(),
            token: Some(Secret::parse(token).unwrap()),
            ca_cert: None,
        }
    }

    /// Regression: a token with a control character gave "cannot reach
    /// the agent ... hint: check --server".
    #[test]
    fn a_token_with_a_control_character_is_named_not_shown() {
        for bad in [
            "ferry_ab\ncd",
            "ferry_ab\rcd",
            "ferry_a\u{1}b",
            "ferry_a\u{7f}b",
        ] {
            let e = Client::new(&args(bad), REQUEST_TIMEOUT).unwrap_err();
            let text = format!("{e:#}");
            assert!(
                text.contains("token") && text.contains("not a valid HTTP header value"),
                "{text}"
            );
            assert!(!text.contains("ferry_a"), "the token was shown: {text}");
            assert!(!text.contains("--server"), "{text}");
        }
        assert!(Client::new(&args("ferry_abc-123_XYZ"), REQUEST_TIMEOUT).is_ok());
    }
}
