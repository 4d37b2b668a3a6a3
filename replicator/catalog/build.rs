//! Rebuilds the crate when a migration is added or changed.
//!
//! `sqlx::migrate!("../../migrations/sqlite")` and
//! `sqlx::migrate!("../../migrations/postgres")` in `src/lib.rs` embed the
//! migrations at compile time, and on stable Rust a proc macro cannot ask
//! Cargo to watch a directory: a new migration file alone would not
//! rebuild the crate, and the agent and tests would keep migrating to the
//! previous schema. This is the build script sqlx recommends
//! (`sqlx migrate build-script`).
fn main() {
    println!("cargo:rerun-if-changed=../../migrations/sqlite");
    println!("cargo:rerun-if-changed=../../migrations/postgres");
}
