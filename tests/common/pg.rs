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
