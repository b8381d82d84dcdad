//! What tandem's two worker processes share, and nothing role-specific:
//! `prefill-worker` and `decode-worker` build their binaries on it.
//!
//! Owns: the config layers both read ([`config`]: flags over env over TOML
//! over defaults, with a named field in every error), model start-up, the
//! layout fingerprint, deadlines and runner-error mapping ([`serve`]), the
//! `Health` statistics cache ([`health`]), the slow tick that gives the
//! allocator's free pages back ([`heap`]), and the Prometheus install plus
//! the metrics both roles export ([`metrics`]).
//!
//! Must not: know a role's service, its KV path or its policy; those live in
//! the role crates.

#![forbid(unsafe_code)]

pub mod config;
pub mod cpu;
pub mod health;
pub mod heap;
pub mod metrics;
pub mod prefix_feed;
pub mod serve;
