//! Mutual TLS between Ferry agents.
//!
//! Every agent holds a leaf certificate whose DNS subjectAltName is its agent
//! name (e.g. `train-a-1`), signed by a shared CA. Both sides of a QUIC
//! connection verify the other against that CA; the client additionally checks
//! that the server's SAN equals the `server_name` it dialed.

use std::fs;
use std::io::{self, Write};
use std::net::IpAddr;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use quinn::ConnectionError;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use time::{Duration, OffsetDateTime};
use x509_parser::extensions::GeneralName;

/// ALPN protocol identifier spoken between Ferry agents.
pub const ALPN: &[u8] = b"ferry/1";

/// Minimum lifetime of a freshly created dev CA, in days.
const CA_MIN_VALIDITY_DAYS: u32 = 3650;

/// Errors from loading or creating TLS material and building TLS configs.
/// Every message names the file (or agent) involved.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A required file does not exist.
    #[error("{}: file not found", .0.display())]
    Missing(PathBuf),
    /// A file exists but could not be read.
    #[error("cannot read {p}: {1}", p = .0.display())]
    Read(PathBuf, #[source] io::Error),
    /// A file or directory could not be written.
    #[error("cannot write {p}: {1}", p = .0.display())]
    Write(PathBuf, #[source] io::Error),
    /// The file holds no PEM `CERTIFICATE` section.
    #[error("no certificate found in {}", .0.display())]
    NoCertificate(PathBuf),
    /// The file holds no PEM private key section.
    #[error("no private key found in {}", .0.display())]
    NoKey(PathBuf),
    /// The file is not valid PEM.
    #[error("malformed PEM in {p}: {1}", p = .0.display())]
    Pem(PathBuf, #[source] pem::Error),
    /// A certificate or key in the file is unusable.
    #[error("invalid certificate or key in {p}: {1}", p = .0.display())]
    Invalid(PathBuf, String),
    /// The certificate carries no DNS subjectAltName, so it names no agent.
    #[error("certificate in {} has no DNS subjectAltName (agent name)", .0.display())]
    NoAgentName(PathBuf),
    /// An agent name is not a usable DNS name.
    #[error("invalid agent name {0:?}: use lowercase letters, digits, '-' and '.' (not \"ca\", not an IP address)")]
    InvalidAgentName(String),
    /// `validity_days` was zero.
    #[error("validity_days must be at least 1")]
    ZeroValidity,
    /// An API host name is neither a DNS name nor an IP address.
    #[error(
        "invalid API host {0:?}: give a DNS name (letters, digits, '-' and '.') or an IP address"
    )]
    InvalidApiHost(String),
    /// Only one of `ca.pem` and `ca.key` exists in the directory.
    #[error("{}: ca.pem and ca.key must both exist (to reuse the CA) or both be absent", .0.display())]
    IncompleteCa(PathBuf),
    /// Certificate generation or signing failed for this file.
    #[error("cannot generate {p}: {1}", p = .0.display())]
    Generate(PathBuf, #[source] rcgen::Error),
    /// rustls or quinn rejected the configuration built for this agent.
    #[error("invalid TLS configuration for agent {0}: {1}")]
    Config(String, String),
}

/// Creates (or extends) a development PKI in `out`.
///
/// Writes `ca.pem`/`ca.key` unless both already exist, in which case that CA
/// is reused so agents can be added later (a new CA is valid for at least ten
/// years). For each agent writes `<name>.pem` (leaf with SAN = name,
/// serverAuth + clientAuth, valid for `validity_days`) and `<name>.key`
/// (mode 0600). Returns the written paths.
pub fn init_dev_pki(
    out: &Path,
    agents: &[String],
    validity_days: u32,
) -> Result<Vec<PathBuf>, TlsError> {
    init_dev_pki_with_api(out, agents, &[], validity_days)
}

/// Like [`init_dev_pki`]; when `api_hosts` is not empty, also writes for
/// each agent an HTTPS certificate for its REST API,
/// `<name>-api.pem` (serverAuth only; SANs: the agent name and every host
/// in `api_hosts`, each a DNS name such as `localhost` or an IP address
/// such as `127.0.0.1`) and `<name>-api.key` (mode 0600), signed by the
/// same CA. It is kept apart from the agent's QUIC certificate so that
/// host names never widen what an agent name authenticates.
pub fn init_dev_pki_with_api(
    out: &Path,
    agents: &[String],
    api_hosts: &[String],
    validity_days: u32,
) -> Result<Vec<PathBuf>, TlsError> {
    if validity_days == 0 {
        return Err(TlsError::ZeroValidity);
    }
    if let Some(bad) = agents.iter().find(|a| !valid_agent_name(a)) {
        return Err(TlsError::InvalidAgentName(bad.clone()));
    }
    if let Some(bad) = api_hosts.iter().find(|h| !valid_api_host(h)) {
        return Err(TlsError::InvalidApiHost(bad.clone()));
    }
    fs::create_dir_all(out).map_err(|e| TlsError::Write(out.to_owned(), e))?;
    let (ca_path, ca_key_path) = (out.join("ca.pem"), out.join("ca.key"));
    let gen_err = |path: &Path| {
        let path = path.to_owned();
        move |e| TlsError::Generate(path, e)
    };
    let mut written = Vec::new();
    let (ca, ca_key) = match (ca_path.exists(), ca_key_path.exists()) {
        (true, true) => {
            let der = read_certs(&ca_path)?.swap_remove(0);
            let key_pem = String::from_utf8_lossy(&read(&ca_key_path)?).into_owned();
            let key = KeyPair::from_pem(&key_pem).map_err(|e| invalid(&ca_key_path, e))?;
            let (_, parsed) =
                x509_parser::parse_x509_certificate(&der).map_err(|e| invalid(&ca_path, e))?;
            if parsed.public_key().raw != key.public_key_der().as_slice() {
                let why = format!("does not match the key in {}", ca_key_path.display());
                return Err(TlsError::Invalid(ca_path, why));
            }
            let params = CertificateParams::from_ca_cert_der(&der).map_err(gen_err(&ca_path))?;
            // Re-signing only rebuilds rcgen's issuer handle; ca.pem is not rewritten.
            (params.self_signed(&key).map_err(gen_err(&ca_path))?, key)
        }
        (false, false) => {
            let key = KeyPair::generate().map_err(gen_err(&ca_key_path))?;
            // A unique name keeps separately created dev CAs distinguishable.
            let cn = format!("Ferry dev CA {:016x}", rand::random::<u64>());
            let days = validity_days.max(CA_MIN_VALIDITY_DAYS);
            let mut params = base_params(Vec::new(), cn, days, &ca_path)?;
            params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            let cert = params.self_signed(&key).map_err(gen_err(&ca_path))?;
            write_file(&ca_path, &cert.pem(), 0o644)?;
            write_file(&ca_key_path, &key.serialize_pem(), 0o600)?;
            written.extend([ca_path, ca_key_path]);
            (cert, key)
        }
        _ => return Err(TlsError::IncompleteCa(out.to_owned())),
    };
    for name in agents {
        let cert_path = out.join(format!("{name}.pem"));
        let key_path = out.join(format!("{name}.key"));
        let key = KeyPair::generate().map_err(gen_err(&key_path))?;
        let mut params = base_params(vec![name.clone()], name.clone(), validity_days, &cert_path)?;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &ca, &ca_key);
        write_file(&cert_path, &cert.map_err(gen_err(&cert_path))?.pem(), 0o644)?;
        write_file(&key_path, &key.serialize_pem(), 0o600)?;
        written.extend([cert_path, key_path]);
        if api_hosts.is_empty() {
            continue;
        }
        let cert_path = out.join(format!("{name}-api.pem"));
        let key_path = out.join(format!("{name}-api.key"));
        let key = KeyPair::generate().map_err(gen_err(&key_path))?;
        let mut sans = vec![name.clone()];
        for h in api_hosts {
            if !sans.contains(h) {
                sans.push(h.clone());
            }
        }
        let mut params = base_params(sans, format!("{name} API"), validity_days, &cert_path)?;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &ca, &ca_key);
        write_file(&cert_path, &cert.map_err(gen_err(&cert_path))?.pem(), 0o644)?;
        write_file(&key_path, &key.serialize_pem(), 0o600)?;
        written.extend([cert_path, key_path]);
    }
    Ok(written)
}

/// The rustls server configuration of the REST API's HTTPS listener: the
/// certificate chain in `cert` (PEM, leaf first) and its private key in
/// `key`, TLS 1.2 and 1.3 with the ring provider, ALPN `h2` and
/// `http/1.1`, no client certificate (clients send bearer tokens).
///
/// # Errors
/// A [`TlsError`] naming the file that is missing, malformed or does not
/// match.
pub fn api_server_config(cert: &Path, key: &Path) -> Result<rustls::ServerConfig, TlsError> {
    let chain = read_certs(cert)?;
    let key_der = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| match e {
        pem::Error::NoItemsFound => TlsError::NoKey(key.to_owned()),
        e => TlsError::Pem(key.to_owned(), e),
    })?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(ring_provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(cert, e))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| {
            TlsError::Invalid(
                cert.to_owned(),
                format!("{e} (is {} the key of this certificate?)", key.display()),
            )
        })?;
    // HTTP/1.1 only: see the API server in src/apiserve.rs.
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// Certificate parameters with the given SANs and CN, valid from an hour ago
/// (clock skew) for `days` days.
fn base_params(
    sans: Vec<String>,
    cn: String,
    days: u32,
    path: &Path,
) -> Result<CertificateParams, TlsError> {
    let mut params =
        CertificateParams::new(sans).map_err(|e| TlsError::Generate(path.to_owned(), e))?;
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, cn);
    let now = OffsetDateTime::now_utc();
    params.not_before = now - Duration::hours(1);
    params.not_after = now + Duration::days(days.into());
    Ok(params)
}

/// An agent's TLS identity: trusted CA roots, own certificate chain and key.
#[derive(Debug)]
pub struct AgentIdentity {
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    name: String,
}

impl AgentIdentity {
    /// Loads the CA bundle, own certificate chain (leaf first) and private key
    /// from PEM files. The agent name is the leaf's first DNS SAN.
    pub fn load(ca: &Path, cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let mut roots = RootCertStore::empty();
        for c in read_certs(ca)? {
            roots.add(c).map_err(|e| invalid(ca, e))?;
        }
        let chain = read_certs(cert)?;
        let name = dns_san(&chain[0]).ok_or_else(|| TlsError::NoAgentName(cert.to_owned()))?;
        let key_der = PrivateKeyDer::from_pem_slice(&read(key)?).map_err(|e| match e {
            pem::Error::NoItemsFound => TlsError::NoKey(key.to_owned()),
            e => TlsError::Pem(key.to_owned(), e),
        })?;
        Ok(Self {
            roots: Arc::new(roots),
            chain,
            key: key_der,
            name,
        })
    }

    /// A 32-byte secret derived from the agent's private key (BLAKE3
    /// `derive_key`), stable across restarts: the QUIC stateless-reset key
    /// (see [`crate::transport::endpoint_with_reset_key`]).
    pub fn reset_key(&self) -> [u8; 32] {
        blake3::derive_key(
            "ferry 2026-11 QUIC stateless reset key",
            self.key.secret_der(),
        )
    }

    /// This agent's name (the DNS SAN of its own certificate).
    pub fn name(&self) -> &str {
        &self.name
    }

    fn config_err(&self, e: impl std::fmt::Display) -> TlsError {
        TlsError::Config(self.name.clone(), e.to_string())
    }
}

/// Server-side QUIC crypto: TLS 1.3, ALPN `ferry/1`, and a client certificate
/// chaining to the CA is required.
pub fn server_crypto(id: &AgentIdentity) -> Result<Arc<QuicServerConfig>, TlsError> {
    let provider = ring_provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(id.roots.clone(), provider.clone())
        .build()
        .map_err(|e| id.config_err(e))?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| id.config_err(e))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(id.chain.clone(), id.key.clone_key())
        .map_err(|e| id.config_err(e))?;
    cfg.alpn_protocols = vec![ALPN.to_vec()];
    let quic = QuicServerConfig::try_from(cfg).map_err(|e| id.config_err(e))?;
    Ok(Arc::new(quic))
}

/// Client-side QUIC crypto: verifies the server against the CA and its SAN
/// against the `server_name` given to `quinn::Endpoint::connect`, presents our
/// own certificate, ALPN `ferry/1`, TLS 1.3.
pub fn client_crypto(id: &AgentIdentity) -> Result<Arc<QuicClientConfig>, TlsError> {
    client_crypto_with_alpn(id, ALPN)
}

fn client_crypto_with_alpn(
    id: &AgentIdentity,
    alpn: &[u8],
) -> Result<Arc<QuicClientConfig>, TlsError> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(ring_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| id.config_err(e))?
        .with_root_certificates(id.roots.clone())
        .with_client_auth_cert(id.chain.clone(), id.key.clone_key())
        .map_err(|e| id.config_err(e))?;
    cfg.alpn_protocols = vec![alpn.to_vec()];
    let quic = QuicClientConfig::try_from(cfg).map_err(|e| id.config_err(e))?;
    Ok(Arc::new(quic))
}

/// The agent name (DNS SAN of the leaf certificate) the peer authenticated with.
pub fn peer_agent_name(conn: &quinn::Connection) -> Option<String> {
    let certs = conn
        .peer_identity()?
        .downcast::<Vec<CertificateDer<'static>>>()
        .ok()?;
    dns_san(certs.first()?)
}

/// Turns a handshake failure into a log-friendly cause: foreign CA, name
/// mismatch, expiry, missing/wrong ALPN, or else the raw error.
pub fn explain_handshake_error(e: &ConnectionError) -> String {
    let (code, reason, by_peer) = match e {
        ConnectionError::TransportError(t) => (t.code, t.reason.clone(), false),
        ConnectionError::ConnectionClosed(c) => (
            c.error_code,
            String::from_utf8_lossy(&c.reason).into_owned(),
            true,
        ),
        other => return format!("connection failed: {other}"),
    };
    // QUIC carries TLS alerts as transport error codes 0x100..=0x1ff.
    let alert = u64::from(code).checked_sub(0x100).filter(|a| *a <= 0xff);
    let r = reason.to_ascii_lowercase();
    // BadSignature: the issuer name matches our CA but another key signed it.
    let foreign_ca = ["unknownissuer", "badsignature"]
        .iter()
        .any(|k| r.contains(k));
    // (as seen by us, as reported by the peer that rejected our certificate)
    let (ours, theirs) = if foreign_ca || matches!(alert, Some(48 | 51)) {
        (
            "peer certificate not signed by our CA",
            "peer rejected our certificate: not signed by the peer's CA",
        )
    } else if r.contains("not valid for name") || r.contains("notvalidforname") {
        (
            "peer name does not match expected (certificate SAN differs from the dialed name)",
            "peer rejected our certificate: its name does not match the name the peer dialed",
        )
    } else if r.contains("expired") || r.contains("not valid yet") || alert == Some(45) {
        (
            "peer certificate expired (or not yet valid)",
            "peer rejected our certificate as expired (or not yet valid)",
        )
    } else if r.contains("known protocol") || alert == Some(120) {
        let alpn = "no/wrong ALPN: peer does not speak ferry/1";
        (alpn, alpn)
    } else {
        return format!("handshake failed: {e}");
    };
    let cause = if by_peer { theirs } else { ours };
    format!("{cause} ({e})")
}

fn ring_provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn valid_agent_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name != "ca"
        && name.parse::<IpAddr>().is_err()
        && dns_labels(name, |b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'
        })
}

/// True if every dot-separated label of `name` is 1 to 63 bytes of
/// `allowed` that neither starts nor ends with `-` (RFC 1123 host names).
fn dns_labels(name: &str, allowed: impl Fn(u8) -> bool) -> bool {
    name.split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label.bytes().all(&allowed)
    })
}

fn valid_api_host(host: &str) -> bool {
    host.parse::<IpAddr>().is_ok()
        || (host.len() <= 253 && dns_labels(host, |b| b.is_ascii_alphanumeric() || b == b'-'))
}

fn dns_san(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, x509) = x509_parser::parse_x509_certificate(cert).ok()?;
    let san = x509.subject_alternative_name().ok()??;
    san.value.general_names.iter().find_map(|n| match n {
        GeneralName::DNSName(d) => Some((*d).to_owned()),
        _ => None,
    })
}

fn invalid(path: &Path, e: impl std::fmt::Display) -> TlsError {
    TlsError::Invalid(path.to_owned(), e.to_string())
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    fs::read(path).map_err(|source| match source.kind() {
        io::ErrorKind::NotFound => TlsError::Missing(path.to_owned()),
        _ => TlsError::Read(path.to_owned(), source),
    })
}

fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(&read(path)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem(path.to_owned(), e))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate(path.to_owned()));
    }
    Ok(certs)
}

fn write_file(path: &Path, contents: &str, mode: u32) -> Result<(), TlsError> {
    let write = || -> io::Result<()> {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(path)?;
        // `mode` only applies on creation; enforce it for pre-existing files too.
        f.set_permissions(fs::Permissions::from_mode(mode))?;
        f.write_all(contents.as_bytes())
    };
    write().map_err(|e| TlsError::Write(path.to_owned(), e))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration as StdDuration;

    use quinn::{ClientConfig, Connection, Endpoint, ServerConfig};
    use tempfile::TempDir;

    use super::*;

    fn pki(agents: &[&str]) -> TempDir {
        let dir = tempfile::tempdir().unwrap();
        let agents: Vec<String> = agents.iter().map(|a| a.to_string()).collect();
        init_dev_pki(dir.path(), &agents, 30).unwrap();
        dir
    }

    /// Identity trusting the CA in `ca`, with the cert and key of `name` from `certs`.
    fn ident(ca: &TempDir, certs: &TempDir, name: &str) -> AgentIdentity {
        let file = |ext: &str| certs.path().join(format!("{name}.{ext}"));
        AgentIdentity::load(&ca.path().join("ca.pem"), &file("pem"), &file("key")).unwrap()
    }

    type Side = Result<Connection, ConnectionError>;

    /// Runs one handshake on loopback; returns (server side, client side).
    async fn handshake(
        srv: &AgentIdentity,
        cli: Arc<QuicClientConfig>,
        name: &str,
    ) -> (Side, Side) {
        let srv_cfg = ServerConfig::with_crypto(server_crypto(srv).unwrap());
        let srv = Endpoint::server(srv_cfg, "127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = srv.local_addr().unwrap();
        let mut client = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        client.set_default_client_config(ClientConfig::new(cli));
        let accept = async { srv.accept().await.unwrap().await };
        let connect = async { client.connect(addr, name).unwrap().await };
        let both = async { tokio::join!(accept, connect) };
        tokio::time::timeout(StdDuration::from_secs(10), both)
            .await
            .unwrap()
    }

    /// Explained (server, client) failures of a handshake that must fail.
    async fn refused(
        srv: &AgentIdentity,
        cli: Arc<QuicClientConfig>,
        name: &str,
    ) -> (String, String) {
        let (s, c) = handshake(srv, cli, name).await;
        // The client may complete its half before the server rejects it; the
        // error then arrives as the close reason.
        let c = match c {
            Err(e) => e,
            Ok(conn) => tokio::time::timeout(StdDuration::from_secs(10), conn.closed())
                .await
                .unwrap(),
        };
        (
            explain_handshake_error(&s.unwrap_err()),
            explain_handshake_error(&c),
        )
    }

    #[tokio::test]
    async fn same_ca_agents_connect_and_learn_names() {
        let dir = pki(&["train-a-1", "eval-b-1"]);
        let ca_before = fs::read(dir.path().join("ca.pem")).unwrap();
        // Adding an agent later reuses the existing CA.
        let written = init_dev_pki(dir.path(), &["ckpt-c-1".to_string()], 30).unwrap();
        assert_eq!(
            written,
            [
                dir.path().join("ckpt-c-1.pem"),
                dir.path().join("ckpt-c-1.key")
            ]
        );
        assert_eq!(fs::read(dir.path().join("ca.pem")).unwrap(), ca_before);
        let mode = fs::metadata(&written[1]).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);

        let server = ident(&dir, &dir, "eval-b-1");
        assert_eq!(server.name(), "eval-b-1");
        for client_name in ["train-a-1", "ckpt-c-1"] {
            let client = client_crypto(&ident(&dir, &dir, client_name)).unwrap();
            let (s, c) = handshake(&server, client, "eval-b-1").await;
            let (s, c) = (s.unwrap(), c.unwrap());
            assert_eq!(peer_agent_name(&s).as_deref(), Some(client_name));
            assert_eq!(peer_agent_name(&c).as_deref(), Some("eval-b-1"));
        }
    }

    #[tokio::test]
    async fn mismatches_are_refused_and_explained() {
        let (a, b) = (
            pki(&["train-a-1", "eval-b-1"]),
            pki(&["train-a-1", "eval-b-1"]),
        );
        let server = ident(&a, &a, "eval-b-1");
        let client = client_crypto(&ident(&a, &a, "train-a-1")).unwrap();

        // The client trusts the server's CA but presents a certificate from another CA.
        let rogue = client_crypto(&ident(&a, &b, "train-a-1")).unwrap();
        let (s, c) = refused(&server, rogue, "eval-b-1").await;
        assert!(
            s.starts_with("peer certificate not signed by our CA"),
            "{s}"
        );
        assert!(
            c.starts_with("peer rejected our certificate: not signed"),
            "{c}"
        );

        // The server presents a certificate from another CA.
        let (s, c) = refused(&ident(&a, &b, "eval-b-1"), client.clone(), "eval-b-1").await;
        assert!(
            c.starts_with("peer certificate not signed by our CA"),
            "{c}"
        );
        assert!(
            s.starts_with("peer rejected our certificate: not signed"),
            "{s}"
        );

        // The client dials a name the server's certificate does not carry.
        let (s, c) = refused(&server, client, "wrong-name").await;
        assert!(c.starts_with("peer name does not match expected") && c.contains("wrong-name"));
        assert!(s.contains("does not match the name the peer dialed"), "{s}");

        // The client speaks another protocol.
        let other = client_crypto_with_alpn(&ident(&a, &a, "train-a-1"), b"other/9").unwrap();
        let (s, c) = refused(&server, other, "eval-b-1").await;
        assert!(
            s.starts_with("no/wrong ALPN") && c.starts_with("no/wrong ALPN"),
            "{s} / {c}"
        );
    }

    #[test]
    fn explains_bare_alert_codes() {
        let closed = |alert| {
            ConnectionError::ConnectionClosed(quinn::ConnectionClose {
                error_code: quinn::TransportErrorCode::crypto(alert),
                frame_type: None,
                reason: bytes::Bytes::new(),
            })
        };
        assert!(explain_handshake_error(&closed(45)).contains("expired"));
        assert!(explain_handshake_error(&closed(51)).contains("not signed by the peer's CA"));
        assert!(explain_handshake_error(&ConnectionError::TimedOut).contains("timed out"));
    }

    #[test]
    fn api_certificates_name_the_hosts_and_serve_https_only() {
        let dir = tempfile::tempdir().unwrap();
        let hosts = ["localhost".to_string(), "127.0.0.1".to_string()];
        let written = init_dev_pki_with_api(dir.path(), &["train-a-1".into()], &hosts, 30).unwrap();
        let api_pem = dir.path().join("train-a-1-api.pem");
        let api_key = dir.path().join("train-a-1-api.key");
        assert!(written.contains(&api_pem) && written.contains(&api_key));
        let mode = fs::metadata(&api_key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let der = read_certs(&api_pem).unwrap().swap_remove(0);
        let (_, x509) = x509_parser::parse_x509_certificate(&der).unwrap();
        let san = x509.subject_alternative_name().unwrap().unwrap();
        let names: Vec<String> = san
            .value
            .general_names
            .iter()
            .map(|n| match n {
                GeneralName::DNSName(d) => d.to_string(),
                GeneralName::IPAddress(ip) => format!("ip:{ip:?}"),
                o => format!("{o:?}"),
            })
            .collect();
        assert_eq!(names, ["train-a-1", "localhost", "ip:[127, 0, 0, 1]"]);
        let eku = x509.extended_key_usage().unwrap().unwrap().value;
        assert!(eku.server_auth && !eku.client_auth, "server use only");
        // The agent's own certificate keeps its one SAN.
        let agent = read_certs(&dir.path().join("train-a-1.pem")).unwrap();
        assert_eq!(dns_san(&agent[0]).as_deref(), Some("train-a-1"));

        let cfg = api_server_config(&api_pem, &api_key).unwrap();
        assert_eq!(cfg.alpn_protocols, [b"http/1.1".to_vec()]);
        // The agent's key does not match the API certificate.
        let e = api_server_config(&api_pem, &dir.path().join("train-a-1.key")).unwrap_err();
        assert!(e.to_string().contains("train-a-1-api.pem"), "{e}");
        let e = api_server_config(&dir.path().join("nope.pem"), &api_key).unwrap_err();
        assert!(matches!(e, TlsError::Missing(_)), "{e}");
        for bad in ["", "a b", "-x", "a..b", "x_y"] {
            let e =
                init_dev_pki_with_api(dir.path(), &["b".into()], &[bad.into()], 30).unwrap_err();
            assert!(matches!(e, TlsError::InvalidApiHost(_)), "{bad:?}: {e}");
        }
    }

    #[test]
    fn load_errors_name_the_file() {
        let dir = pki(&["train-a-1"]);
        let path = |f: &str| dir.path().join(f);
        let (ca, cert, key) = (path("ca.pem"), path("train-a-1.pem"), path("train-a-1.key"));
        let err = AgentIdentity::load(&path("nope.pem"), &cert, &key).unwrap_err();
        assert!(matches!(err, TlsError::Missing(_)) && err.to_string().contains("nope.pem"));

        fs::write(path("junk.pem"), "hello, no PEM here\n").unwrap();
        let err = AgentIdentity::load(&ca, &path("junk.pem"), &key).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("no certificate found in {}", path("junk.pem").display())
        );

        // A certificate where the key should be.
        let err = AgentIdentity::load(&ca, &cert, &cert).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!("no private key found in {}", cert.display())
        );
    }

    #[test]
    fn pki_validates_inputs() {
        let dir = tempfile::tempdir().unwrap();
        for bad in ["", "Train-a", "a_b", "../x", "ca", "-a", "a..b", "10.0.0.1"] {
            let err = init_dev_pki(dir.path(), &[bad.to_string()], 30).unwrap_err();
            assert!(matches!(err, TlsError::InvalidAgentName(_)), "{bad}: {err}");
        }
        let one = ["a".to_string()];
        assert!(matches!(
            init_dev_pki(dir.path(), &one, 0),
            Err(TlsError::ZeroValidity)
        ));
        fs::write(dir.path().join("ca.pem"), "x").unwrap();
        let err = init_dev_pki(dir.path(), &one, 30).unwrap_err();
        assert!(matches!(err, TlsError::IncompleteCa(_)), "{err}");
    }
}
