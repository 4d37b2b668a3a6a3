//! The PostgreSQL test server that `ops/test` starts: its URL, and a
//! fresh database per test.

#![allow(dead_code)]

use sqlx::Connection;

/// The test server's URL (`FERRY_TEST_PG_URL`); the test fails, never
/// skips, without it.
pub fn pg_url() -> String {
    std::env::var("FERRY_TEST_PG_URL").unwrap_or_else(|_| {
        panic!(
            "FERRY_TEST_PG_URL is not set: this test needs a PostgreSQL server; run it through \
             ops/test (or ops/with-test-pg cargo test ...), which starts one"
        )
    })
}

/// `url` with database `name`.
pub fn with_db(url: &str, name: &str) -> String {
    let (server, _) = url.rsplit_once('/').unwrap();
    format!("{server}/{name}")
}

/// Runs `sql` on the test server's maintenance database.
pub async fn pg_admin(sql: &str) {
    let mut c = sqlx::PgConnection::connect(&pg_url()).await.unwrap();
    sqlx::query(sql).execute(&mut c).await.unwrap();
    c.close().await.unwrap();
}

/// A fresh, empty database `ferry_<name>_<this process>` on the test
/// server (dropped first if a killed run left it); its URL.
pub async fn fresh_db(name: &str) -> String {
    let name = format!("ferry_{name}_{}", std::process::id());
    pg_admin(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
    pg_admin(&format!("CREATE DATABASE {name}")).await;
    with_db(&pg_url(), &name)
}

/// Drops the database of `url` (connections to it are closed first).
pub async fn drop_db(url: &str) {
    let name = url.rsplit_once('/').unwrap().1;
    pg_admin(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).await;
}

/// The test PostgreSQL server's address (from `FERRY_TEST_PG_URL`).
pub async fn pg_addr() -> std::net::SocketAddr {
    let u = pg_url();
    let host = u
        .split('@')
        .nth(1)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string();
    tokio::net::lookup_host(host).await.unwrap().next().unwrap()
}

/// A TCP forwarder from a loopback port to `to` whose connections can be
/// cut, and new ones refused, while `down` is set: the catalog going
/// away for one agent only (the test's PostgreSQL server stays up for
/// the other tests).
pub struct Cut {
    /// The loopback port agents reach the catalog through.
    pub port: u16,
    down: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Black hole: connections stay open and nothing goes through.
    hole: std::sync::Arc<std::sync::atomic::AtomicBool>,
    cut: tokio_util::sync::CancellationToken,
    gen: std::sync::Arc<std::sync::Mutex<tokio_util::sync::CancellationToken>>,
}

impl Cut {
    /// Starts forwarding to `to`.
    pub async fn start(to: std::net::SocketAddr) -> Cut {
        use std::sync::atomic::Ordering;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let down = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let gen = std::sync::Arc::new(std::sync::Mutex::new(
            tokio_util::sync::CancellationToken::new(),
        ));
        let cut = tokio_util::sync::CancellationToken::new();
        let hole = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (d2, g2, c2, h2) = (down.clone(), gen.clone(), cut.clone(), hole.clone());
        tokio::spawn(async move {
            loop {
                let accepted = tokio::select! {
                    a = l.accept() => a,
                    _ = c2.cancelled() => return,
                };
                let Ok((mut inbound, _)) = accepted else {
                    continue;
                };
                if d2.load(Ordering::SeqCst) {
                    continue;
                }
                let token = g2.lock().unwrap().clone();
                let (h3, c3) = (h2.clone(), c2.clone());
                tokio::spawn(async move {
                    let Ok(mut out) = tokio::net::TcpStream::connect(to).await else {
                        return;
                    };
                    if !h3.load(Ordering::SeqCst) {
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut out) => return,
                            _ = token.cancelled() => {}
                        }
                    }
                    // A black hole keeps both ends open, silent, until
                    // the test ends.
                    if h3.load(Ordering::SeqCst) {
                        c3.cancelled().await;
                    }
                });
            }
        });
        Cut {
            port,
            down,
            hole,
            cut,
            gen,
        }
    }

    /// Cuts every connection and refuses new ones.
    pub fn down(&self) {
        self.down.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut g = self.gen.lock().unwrap();
        g.cancel();
        *g = tokio_util::sync::CancellationToken::new();
    }

    /// Lets connections through again.
    pub fn up(&self) {
        self.down.store(false, std::sync::atomic::Ordering::SeqCst);
    }

    /// Makes every connection, open or new, a black hole: the peer's
    /// packets go nowhere and nothing comes back, as behind a dead route.
    pub fn black_hole(&self) {
        self.hole.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut g = self.gen.lock().unwrap();
        g.cancel();
        *g = tokio_util::sync::CancellationToken::new();
    }
}

impl Drop for Cut {
    fn drop(&mut self) {
        self.cut.cancel();
    }
}
