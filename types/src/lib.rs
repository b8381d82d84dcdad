//! The types that cross crate boundaries: what a KV block is (layout, dtype,
//! block ids), how to sample (parameters and their validation), a request's
//! priority class, and the workspace's one small seeded generator ([`rng`]).
//!
//! A leaf: it depends on nothing of tandem's, so the KV transfer (`kvtransfer`)
//! and the wire API (`proto`) can speak of blocks and sampling without
//! compiling the engine, its tokenizer or its kernels. It owns no behaviour
//! beyond describing and validating these values, and [`memory::SharedMemory`]:
//! foreign memory the engine's pool adopts, named here so the transport that
//! allocates it needs no engine (its module is the crate's only `unsafe`; the
//! workspace denies it everywhere else).

pub mod kv;
pub mod memory;
pub mod priority;
pub mod rng;
pub mod sampling;
