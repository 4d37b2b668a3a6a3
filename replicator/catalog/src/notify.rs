//! The pool's notification channel: what a write announces to every
//! agent of a PostgreSQL catalog (`NOTIFY`), so they read it at once
//! instead of at their next periodic read.

use sqlx::AnyConnection;

use crate::dialect::Dialect;

/// The PostgreSQL notification channel of the pool (`LISTEN ferry_pool`).
pub const POOL_CHANNEL: &str = "ferry_pool";

/// Payloads announced on [`POOL_CHANNEL`].
pub mod payload {
    /// A setting or a job changed.
    pub const SETTINGS: &str = "settings";
    /// A training controller's signal was stored.
    pub const SIGNAL: &str = "signal";
    /// A striped transfer's plan was stored: its parts are claimable.
    pub const PLAN: &str = "plan";
    /// An agent claimed parts of a striped transfer it held none of, or
    /// ended its last part of one with none left to claim: the agents
    /// holding its parts, and so each one's share of the link's budget,
    /// changed.
    pub const HOLDERS: &str = "holders";
}

/// Announces `what` on [`POOL_CHANNEL`] within `tx` (PostgreSQL only;
/// delivered when the transaction commits).
pub(crate) async fn announce(
    db: Dialect,
    tx: &mut AnyConnection,
    what: &str,
) -> Result<(), sqlx::Error> {
    if db == Dialect::Postgres {
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(POOL_CHANNEL)
            .bind(what)
            .execute(&mut *tx)
            .await?;
    }
    Ok(())
}
