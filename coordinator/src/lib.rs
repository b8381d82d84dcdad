//! tandem's coordinator: what clients talk to. It validates and tokenizes
//! requests once, admits or sheds them, picks a decode worker (and the
//! prefill workers it may use), streams tokens back as text, and maps every
//! worker error onto the documented HTTP and gRPC contracts.
//!
//! The OpenAI-compatible HTTP frontend ([`http`]) and its gRPC twin
//! ([`grpc`], with health and reflection) share one request walk
//! ([`pipeline`]): API key ([`auth`]) and tenant limits ([`tenants`], one
//! budget across every coordinator: [`fleet`]), checks, tokenizing in a
//! bounded pool off the reactor ([`prompt::pool`]), deadline, the central queue
//! ([`admission`]), routing on live worker load ([`load`], [`router`]) over
//! etcd membership or fixed addresses ([`cluster`]), detokenizing with stop
//! strings. Both offer idempotency-key replays ([`idempotency`]), keep
//! retries to their `Retry-After` and a budget ([`retries`]), and export
//! [`metrics`]. Every refusal or failure is an [`error::Error`]
//! saying what went wrong, turned into a status only at each frontend's
//! edge. See docs/ARCHITECTURE.md.
//!
//! Must not: touch KV bytes, or hold a request past its deadline.

#![forbid(unsafe_code)]

pub mod admission;
pub mod auth;
pub mod breaker;
pub mod cluster;
pub mod cursor;
pub mod error;
pub mod fleet;
pub mod grpc;
pub mod http;
pub mod idempotency;
pub mod load;
pub mod metrics;
pub mod openai;
pub mod pipeline;
#[cfg(feature = "fault-injection")]
pub mod plant;
pub mod prefix;
pub mod prompt;
pub mod retries;
pub mod router;
pub mod tenants;
