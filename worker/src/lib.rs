//! tandem's worker processes: `tandem-prefill-worker` ([`prefill`]) computes
//! prompt KV and pushes it into a decode worker's reservation;
//! `tandem-decode-worker` ([`decode`]) reserves KV blocks, has a prefill
//! worker fill them (or prefills locally), and runs continuous-batching
//! decode, streaming tokens to its caller.
//!
//! Owns: each worker's config, its gRPC service, the KV push and receive
//! paths, and the `kv_load_failure_policy`. Shared plumbing (config layers,
//! Prometheus, engine start-up, error mapping) is in [`config`], [`metrics`]
//! and [`serve`].
//!
//! Must not: keep KV it was not asked to keep, queue beyond a small bounded
//! buffer, or hand a reservation's blocks to the engine before every layer
//! arrived intact.

#![forbid(unsafe_code)]

pub mod config;
pub mod decode;
pub mod health;
pub mod metrics;
pub mod prefill;
pub mod serve;
