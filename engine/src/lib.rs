//! tandem's engine: runs a Llama-family model on CPU with a paged KV cache.
//!
//! Owns: weight loading (GGUF, HF safetensors), the tokenizer and chat
//! template, the paged KV block pool, the sampler and the batch step.
//! Must not: know about networks. Transfer code sees only [`types::kv::KvLayout`]
//! and block gather/scatter.

pub mod batch;
pub mod gguf;
pub mod kv;
mod mmap;
pub mod model;
pub mod paths;
pub mod runner;
pub mod sampler;
pub mod tokenizer;
pub mod weights;
