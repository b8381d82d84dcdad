//! tandem's coordinator: what clients talk to. It validates and tokenizes
//! requests once, admits or sheds them, picks a decode worker (and the
//! prefill workers it may use), streams tokens back as text, and maps every
//! worker error onto the documented HTTP and gRPC contracts.
//!
//! Built so far: the OpenAI-compatible HTTP frontend ([`http`]) and its gRPC
//! twin ([`grpc`], with health and reflection) over the frontend-independent
//! request walk ([`pipeline`]: checks, deadline, admission, detokenizing
//! with stop strings), routing from etcd membership or fixed worker
//! addresses ([`cluster`]). Next (see docs/ARCHITECTURE.md): the
//! priority/fairness queue, idempotency keys.
//!
//! Must not: touch KV bytes, or hold a request past its deadline.

#![forbid(unsafe_code)]

pub mod admission;
pub mod auth;
pub mod cluster;
pub mod grpc;
pub mod http;
pub mod idempotency;
pub mod load;
pub mod metrics;
pub mod openai;
pub mod pipeline;
pub mod prompt;
pub mod router;
