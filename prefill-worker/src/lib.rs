//! tandem's prefill worker: serves `PrefillWorker` over gRPC, runs prompts
//! through the engine as prefill-only requests, and pushes every layer's KV
//! into the decode worker's reservation over kvtransfer (TCP).
//!
//! Owns: the worker's config, the gRPC service and the KV push. Must not
//! keep KV after a request: its blocks are released whether the transfer
//! succeeded or not, because the decode worker owns the request.
//!
//! Serves Prometheus `/metrics` on the `metrics` address (see [`metrics`]
//! for every metric and the vLLM one it corresponds to).

#![forbid(unsafe_code)]

pub mod config;
pub mod metrics;
pub mod service;
