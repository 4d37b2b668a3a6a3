//! The library behind the `ferry` command: the agent's configuration
//! ([`config`]) and start-up ([`agent`]), serving its API ([`apiserve`]),
//! the API client and the client commands ([`client`], [`commands`]),
//! printing that survives a closed stdout ([`out`]), the self-contained
//! demo ([`demo`]), policy replay ([`replay`]) and `ferry gen` into HDFS
//! or S3 ([`remote_gen`]). `src/main.rs` is the
//! command line (clap) and dispatch.
//!
//! See ARCHITECTURE.md at the repository root for the map.

pub mod agent;
pub mod apiserve;
pub mod client;
pub mod commands;
pub mod config;
pub mod demo;
pub mod out;
pub mod remote_gen;
pub mod replay;
pub mod webhooks;
