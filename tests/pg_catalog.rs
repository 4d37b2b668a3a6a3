//! Agents whose catalogs live in PostgreSQL (`[catalog] url`): real
//! `ferry serve` processes on databases of the server at
//! `FERRY_TEST_PG_URL` (started by `ops/test`), one fresh database per
//! agent, dropped at the end.

#![allow(clippy::unwrap_used)]

#[allow(dead_code)]
mod common;

use std::time::Duration;

use common::pg::*;
use common::*;
use sqlx::Connection;

/// One column of one row, as text.
async fn one(url: &str, sql: &str) -> String {
    let mut c = sqlx::PgConnection::connect(url).await.unwrap();
    let v: String = sqlx::query_scalar(sql).fetch_one(&mut c).await.unwrap();
    c.close().await.unwrap();
    v
}

/// `ferry catalog migrate --to`: a source that ran on SQLite has its
/// catalog copied into PostgreSQL (the password from a file), restarts on
/// it and lists its published transfer; a second copy into the same
/// database is refused.
#[tokio::test]
async fn an_agent_s_sqlite_catalog_moves_to_postgres() {
    let db = fresh_db("e2e_migrate").await;
    let w = World::new("pgmigrate").await;
    let ckpt = w.source_root().join("step_000200");
    w.gen(&ckpt, "2MB").await;
    let mut c = w.start_cluster("200Mbit/s", &[], |_, _| {}).await;
    let out = w.push(&c.source, &ckpt, &[]).await;
    w.ensure(out.success(), || format!("ferry push failed: {out}"));
    c.source.kill();

    let pw = w.root.join("pg.pass");
    std::fs::write(&pw, "unused-by-trust\n").unwrap();
    let config = c.source.config_path.to_str().unwrap().to_string();
    let migrate = async || {
        w.ferry(
            &[
                "catalog",
                "migrate",
                "--to",
                &db,
                "--password-file",
                pw.to_str().unwrap(),
                "--config",
                &config,
            ],
            &[],
            Duration::from_secs(60),
        )
        .await
    };
    let out = migrate().await;
    w.ensure(
        out.success() && out.stdout.contains("transfers: 1 rows"),
        || format!("ferry catalog migrate failed: {out}"),
    );
    w.ensure(!out.all().contains("unused-by-trust"), || {
        format!("the password was printed: {out}")
    });

    c.source.cfg.tail = format!("\n[catalog]\nurl = {}\n", toml_str(&db));
    std::fs::write(&c.source.config_path, c.source.cfg.to_toml()).unwrap();
    w.restart(&mut c.source).await;
    let ts = w.transfers(&c.source).await;
    w.ensure(ts.len() == 1 && s(&ts[0], "state") == "published", || {
        format!("on PostgreSQL the source lists {ts:?}")
    });
    c.source.kill();
    // Its config now names PostgreSQL: a copy (--to) is refused, naming
    // why, and without --to the schema is brought up to date.
    let out = migrate().await;
    w.ensure(
        !out.success()
            && out
                .all()
                .contains("already puts this agent's catalog in PostgreSQL"),
        || format!("--to with a config on PostgreSQL should be refused: {out}"),
    );
    let out = w
        .ferry(
            &["catalog", "migrate", "--config", &config],
            &[],
            Duration::from_secs(60),
        )
        .await;
    w.ensure(
        out.success() && out.stdout.contains("schema at version"),
        || format!("ferry catalog migrate without --to: {out}"),
    );
    // A second copy into a catalog with transfers is refused.
    let other = w.root.join("other.toml");
    std::fs::write(
        &other,
        std::fs::read_to_string(&c.source.config_path)
            .unwrap()
            .replace(&c.source.cfg.tail, ""),
    )
    .unwrap();
    let out = w
        .ferry(
            &[
                "catalog",
                "migrate",
                "--to",
                &db,
                "--config",
                other.to_str().unwrap(),
            ],
            &[],
            Duration::from_secs(60),
        )
        .await;
    w.ensure(
        !out.success() && out.all().contains("already holds 1 transfers"),
        || format!("a second copy into a catalog with transfers should be refused: {out}"),
    );
    c.sink.kill();
    drop_db(&db).await;
}

/// A source and a sink whose catalogs are PostgreSQL databases replicate
/// a checkpoint; the rows are in PostgreSQL (no SQLite file in the data
/// directories), and the state survives a restart. An agent of another
/// site given the source's database through `FERRY_CATALOG_URL` (which
/// overrides the config) is refused, naming both sites, and the password
/// in that URL is not printed.
#[tokio::test]
async fn agents_on_postgres_catalogs_replicate_and_another_site_is_refused() {
    let src_db = fresh_db("e2e_src").await;
    let sink_db = fresh_db("e2e_sink").await;
    let w = World::new("pgcat").await;
    let ckpt = w.source_root().join("step_000100");
    w.gen(&ckpt, "5MB").await;
    let catalog = |url: &str| format!("\n[catalog]\nurl = {}\n", toml_str(url));
    let mut c = w
        .start_cluster("200Mbit/s", &[], |sink, src| {
            sink.tail = catalog(&sink_db);
            src.tail = catalog(&src_db);
        })
        .await;
    let out = w.push(&c.source, &ckpt, &[]).await;
    w.ensure(out.success(), || format!("ferry push failed: {out}"));
    let replica = w.replica_path("step_000100");
    w.assert_same_tree(&ckpt, &replica);
    // `ferry verify` reads the manifest from the sink's PostgreSQL catalog.
    let v = w.verify(&c.sink, &replica).await;
    w.ensure(v.success(), || {
        format!("ferry verify on PostgreSQL failed: {v}")
    });

    for a in [&c.source, &c.sink] {
        let db = a.cfg.data_dir.join("ferry.db");
        w.ensure(!db.exists(), || {
            format!("{} made an SQLite catalog {}", a.label, db.display())
        });
    }
    let path = ckpt.to_str().unwrap();
    let state = format!("SELECT state FROM transfers WHERE source_path = '{path}'");
    w.ensure(one(&src_db, &state).await == "published", || {
        "the source's transfer row in PostgreSQL is not published".into()
    });
    let state = format!("SELECT state FROM replicas WHERE source_path = '{path}'");
    w.ensure(one(&sink_db, &state).await == "published", || {
        "the sink's replica row in PostgreSQL is not published".into()
    });
    let site = "SELECT site FROM catalog_site";
    w.ensure(one(&src_db, site).await == c.source.cfg.site, || {
        "the source's site is not recorded".into()
    });

    // A restart keeps what the catalog holds.
    w.restart(&mut c.source).await;
    let ts = w.transfers(&c.source).await;
    w.ensure(ts.len() == 1 && s(&ts[0], "state") == "published", || {
        format!("after a restart the source lists {ts:?}")
    });

    // Another site on the source's database, through the environment.
    let mut other = w.source_config("127.0.0.1:9", "200Mbit/s");
    other.site = "other-site".into();
    other.data_dir = w.root.join("other").join("data");
    let dir = w.root.join("other");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("ferry.toml");
    std::fs::write(&config, other.to_toml()).unwrap();
    let secret = "NotShown-4711";
    let env_url = src_db.replacen("postgres@", &format!("postgres:{secret}@"), 1);
    w.ensure(env_url.contains(secret), || {
        format!("FERRY_TEST_PG_URL has an unexpected form: {src_db}")
    });
    let out = w
        .ferry(
            &["serve", "--config", config.to_str().unwrap()],
            &[("FERRY_CATALOG_URL", &env_url)],
            Duration::from_secs(60),
        )
        .await;
    w.ensure(!out.success(), || {
        format!("an agent of another site started on the source's catalog: {out}")
    });
    let all = out.all();
    w.ensure(
        all.contains("'train-a'") && all.contains("'other-site'") && all.contains(":***@"),
        || format!("the refusal should name both sites and the URL redacted: {out}"),
    );
    w.ensure(!all.contains(secret), || {
        format!("the password was printed: {out}")
    });

    c.source.kill();
    c.sink.kill();
    drop_db(&src_db).await;
    drop_db(&sink_db).await;
}
