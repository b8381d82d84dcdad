//! tandem's wire API: the `.proto` files under `proto/` and the tonic/prost
//! code generated from them at build time (protoc from `protobuf-compiler`,
//! installed by `make deps`).
//!
//! This crate owns the message and service definitions for every gRPC hop —
//! client -> coordinator ([`frontend::v1::frontend_server`]),
//! coordinator -> decode worker ([`worker::v1::decode_worker_server`]) and
//! decode worker -> prefill worker ([`worker::v1::prefill_worker_server`]) —
//! plus small, lossless conversions between wire types and the engine's types
//! ([`worker::v1::SamplingParams`] <-> [`types::sampling::SamplingParams`],
//! [`worker::v1::Priority`] <-> [`types::priority::Priority`]).
//!
//! It must not hold logic: no I/O, no policy, no state. Servers and clients
//! live in the worker and coordinator crates. Conversions that can fail return
//! the engine's typed error instead of guessing a default.
//!
//! Compatibility: packages are versioned (`tandem.worker.v1`,
//! `tandem.frontend.v1`); add fields with new numbers, never renumber or
//! retype one.

#![forbid(unsafe_code)]

mod error_kind;
mod priority;
mod sampling;

/// Worker API: `DecodeWorker` (served by decode workers, called by the
/// coordinator) and `PrefillWorker` (served by prefill workers, called by
/// decode workers). See `proto/tandem/worker/v1/worker.proto` for every
/// field's meaning.
pub mod worker {
    /// Version 1 of the worker API, package `tandem.worker.v1`.
    pub mod v1 {
        // Generated code: its style is prost's, not ours.
        #![allow(clippy::all, clippy::pedantic, clippy::nursery, missing_docs)]
        tonic::include_proto!("tandem.worker.v1");
    }
}

/// Frontend API: `Frontend` (served by the coordinator, called by clients),
/// the gRPC twin of the OpenAI-compatible HTTP API. See
/// `proto/tandem/frontend/v1/frontend.proto` for every field's meaning.
pub mod frontend {
    /// Version 1 of the frontend API, package `tandem.frontend.v1`.
    pub mod v1 {
        // Generated code: its style is prost's, not ours.
        #![allow(clippy::all, clippy::pedantic, clippy::nursery, missing_docs)]
        tonic::include_proto!("tandem.frontend.v1");
    }
}

/// The encoded `google.protobuf.FileDescriptorSet` of every .proto file in
/// this crate, for gRPC server reflection (`tonic-reflection`).
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tandem_descriptor");
