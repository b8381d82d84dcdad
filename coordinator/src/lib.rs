//! tandem's coordinator: what clients talk to. It validates and tokenizes
//! requests once, admits or sheds them, picks a decode worker (and the
//! prefill workers it may use), streams tokens back as text, and maps every
//! worker error onto the documented HTTP contract.
//!
//! Built so far: the OpenAI-compatible HTTP frontend ([`http`]) over a
//! static worker list ([`cluster`]). Next (see docs/ARCHITECTURE.md): etcd
//! membership instead of the static list, version-group routing, the
//! priority/fairness queue, idempotency keys, the gRPC frontend and
//! `tandem up`.
//!
//! Must not: touch KV bytes, or hold a request past its deadline.

#![forbid(unsafe_code)]

pub mod admission;
pub mod auth;
pub mod cluster;
pub mod http;
pub mod idempotency;
pub mod load;
pub mod metrics;
pub mod openai;
pub mod prompt;
pub mod router;
