//! Certificates a sink or source must refuse: expired, issued by another
//! CA, naming another agent, and a peer outside `accept_peers`. What
//! `tls.rs` unit tests already cover (foreign CA both ways, a dialed name
//! the server's certificate lacks, a wrong ALPN) is not repeated here.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::time::Duration;

use ferry_catalog::Catalog;
use quinn::{ClientConfig, ConnectionError, Endpoint, ServerConfig};
use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair};
use replicator::sink::{Sink, SinkConfig};
use replicator::tls::{self, explain_handshake_error, AgentIdentity};
use replicator::transport::{self, SocketKind};

/// Writes `<name>.pem` and `<name>.key` in `dir`, signed by the dev CA in
/// `dir`, with SAN `san` and the given validity window (days from now).
fn issue(dir: &Path, name: &str, san: &str, from_days: i64, to_days: i64) {
    let ca_key = KeyPair::from_pem(&std::fs::read_to_string(dir.join("ca.key")).unwrap()).unwrap();
    let ca_params =
        CertificateParams::from_ca_cert_pem(&std::fs::read_to_string(dir.join("ca.pem")).unwrap())
            .unwrap();
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let mut params = CertificateParams::new(vec![san.to_string()]).unwrap();
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, san);
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now + time::Duration::days(from_days);
    params.not_after = now + time::Duration::days(to_days);
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &ca, &ca_key).unwrap();
    std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
    std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
}

fn ident(dir: &Path, name: &str) -> AgentIdentity {
    AgentIdentity::load(
        &dir.join("ca.pem"),
        &dir.join(format!("{name}.pem")),
        &dir.join(format!("{name}.key")),
    )
    .unwrap()
}

type Side = Result<quinn::Connection, ConnectionError>;

/// One handshake on loopback between `srv` and `cli` dialing `name`.
async fn handshake(srv: &AgentIdentity, cli: &AgentIdentity, name: &str) -> (Side, Side) {
    let srv_cfg = ServerConfig::with_crypto(tls::server_crypto(srv).unwrap());
    let server = Endpoint::server(srv_cfg, "127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = server.local_addr().unwrap();
    let mut client = Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    client.set_default_client_config(ClientConfig::new(tls::client_crypto(cli).unwrap()));
    let accept = async { server.accept().await.unwrap().await };
    let connect = async {
        match client.connect(addr, name).unwrap().await {
            // The client may finish its half before the server refuses it.
            Ok(c) => match tokio::time::timeout(Duration::from_secs(5), c.closed()).await {
                Ok(e) => Err(e),
                Err(_) => Ok(c),
            },
            Err(e) => Err(e),
        }
    };
    tokio::time::timeout(Duration::from_secs(15), async {
        tokio::join!(accept, connect)
    })
    .await
    .unwrap()
}

/// Explained (server, client) reasons of a handshake that must fail.
async fn refused(srv: &AgentIdentity, cli: &AgentIdentity, name: &str) -> (String, String) {
    let (s, c) = handshake(srv, cli, name).await;
    let s = s.expect_err("the server accepted the handshake");
    let c = c.expect_err("the client kept the connection");
    (explain_handshake_error(&s), explain_handshake_error(&c))
}

fn pki(agents: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let agents: Vec<String> = agents.iter().map(|a| a.to_string()).collect();
    tls::init_dev_pki(dir.path(), &agents, 30).unwrap();
    dir
}

#[tokio::test]
async fn expired_and_not_yet_valid_certificates_are_refused_both_ways() {
    let dir = pki(&["train-a-1", "eval-b-1"]);
    issue(dir.path(), "old-src", "train-a-1", -30, -1);
    issue(dir.path(), "old-sink", "eval-b-1", -30, -1);
    issue(dir.path(), "future-src", "train-a-1", 2, 30);
    let d = dir.path();
    // Control: the good pair connects.
    let (s, c) = handshake(&ident(d, "eval-b-1"), &ident(d, "train-a-1"), "eval-b-1").await;
    assert!(s.is_ok() && c.is_ok(), "{s:?} / {c:?}");

    // From: a source presenting an expired (or not yet valid) certificate.
    for src in ["old-src", "future-src"] {
        let (s, c) = refused(&ident(d, "eval-b-1"), &ident(d, src), "eval-b-1").await;
        assert!(
            s.starts_with("peer certificate expired (or not yet valid)"),
            "{src}: {s}"
        );
        assert!(
            c.starts_with("peer rejected our certificate as expired"),
            "{src}: {c}"
        );
    }
    // To: a sink presenting an expired certificate.
    let (s, c) = refused(&ident(d, "old-sink"), &ident(d, "train-a-1"), "eval-b-1").await;
    assert!(
        c.starts_with("peer certificate expired (or not yet valid)"),
        "{c}"
    );
    assert!(
        s.starts_with("peer rejected our certificate as expired"),
        "{s}"
    );
}

#[tokio::test]
async fn a_sink_certificate_naming_another_agent_is_refused() {
    // A sink presents a valid certificate of the same CA, but for another
    // agent than the one the source dials.
    let dir = pki(&["train-a-1", "eval-b-1", "eval-c-1"]);
    let d = dir.path();
    let (s, c) = refused(&ident(d, "eval-c-1"), &ident(d, "train-a-1"), "eval-b-1").await;
    assert!(
        c.starts_with("peer name does not match expected") && c.contains("eval-b-1"),
        "{c}"
    );
    assert!(s.contains("does not match the name the peer dialed"), "{s}");
}

#[tokio::test]
async fn a_source_outside_accept_peers_is_refused() {
    // Sources from the sink's own CA whose certificate names an agent not
    // in `accept_peers` (one with a foreign CA is refused in the handshake:
    // tls.rs and tests/e2e.rs).
    let base = tempfile::tempdir().unwrap();
    let d = base.path().join("certs");
    tls::init_dev_pki(
        &d,
        &["train-a-1".into(), "train-z-9".into(), "eval-b-1".into()],
        30,
    )
    .unwrap();
    // A name that merely starts like an accepted one.
    issue(&d, "imposter", "train-a-1.evil", -1, 30);
    let sink_id = ident(&d, "eval-b-1");
    let ep = transport::endpoint(
        SocketKind::Udp("127.0.0.1:0".parse().unwrap()),
        Some(ServerConfig::with_crypto(
            tls::server_crypto(&sink_id).unwrap(),
        )),
    )
    .unwrap();
    let addr = ep.local_addr().unwrap();
    let sink_root = base.path().join("eval");
    let catalog = Catalog::open(&base.path().join("sink-data")).await.unwrap();
    let _sink = Sink::start(
        SinkConfig {
            agent: "eval-b-1".into(),
            site: "eval-b".into(),
            root: sink_root.clone(),
            storage: Default::default(),
            accept_peers: vec!["train-a-1".into()],
            reserve_bytes: 0,
            reread_before_publish: true,
            retention: Vec::new(),
            retention_interval: std::time::Duration::from_secs(60),
            pressure: None,
            pool: None,
        },
        catalog,
        ep,
    )
    .unwrap();
    let client_for = |name: &str| {
        let mut c =
            transport::endpoint(SocketKind::Udp("127.0.0.1:0".parse().unwrap()), None).unwrap();
        c.set_default_client_config(ClientConfig::new(
            tls::client_crypto(&ident(&d, name)).unwrap(),
        ));
        c
    };
    for name in ["train-z-9", "imposter"] {
        let client = client_for(name);
        let conn = client.connect(addr, "eval-b-1").unwrap().await.unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(10), conn.closed())
            .await
            .unwrap();
        match &closed {
            ConnectionError::ApplicationClosed(c) => {
                assert_eq!(
                    c.error_code,
                    quinn::VarInt::from_u32(replicator::conn::code::NOT_ACCEPTED),
                    "{closed}"
                );
                assert_eq!(&c.reason[..], b"agent name not accepted by this sink");
            }
            other => panic!("{name}: expected a close by the sink, got {other}"),
        }
    }
    // Control: the accepted agent gets through the handshake and stays.
    let client = client_for("train-a-1");
    let conn = client.connect(addr, "eval-b-1").unwrap().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(conn.close_reason().is_none(), "{:?}", conn.close_reason());
    assert!(!sink_root.join("train-a").exists());
}
