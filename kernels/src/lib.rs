//! tandem's compute kernels.
//!
//! Owns: the numeric ops a Llama-family forward pass needs — quantized
//! matrix products (Q4_0, Q4_1, Q8_0, F16, BF16, F32 weights), RMSNorm, RoPE,
//! SwiGLU, softmax, attention over a paged KV block table, and KV block
//! gather/scatter — plus the fixed worker pool they run on.
//! Must not: do I/O or anything async.
//!
//! Every op has a portable scalar reference. Where a SIMD path exists it is
//! chosen at run time ([`Isa::detect`]), never by compile-time target
//! features, so one binary runs at full speed on every x86-64 host, and the
//! scalar path stays testable everywhere. SIMD results are tested against the
//! scalar reference on random inputs.

pub mod attention;
pub mod f16;
pub mod isa;
pub mod kvcopy;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod quant;

pub use isa::{Isa, IsaError};

/// The kernels' numerics class, part of a worker's determinism fingerprint.
/// Every ISA level (scalar, AVX2, AVX-512) and every batch size returns the
/// same bits, a rule the tests hold (the SIMD paths against each other and the
/// packed panels against the file layout, at every batch size; the engine's
/// batch against each sequence alone), so one class covers all of them. A
/// backend or kernel whose rounding differs (a GPU, a faster reduction order)
/// must name another class: then a request never moves between workers that
/// would continue it with different tokens.
pub const NUMERICS_CLASS: &str = "cpu-same-bits-every-isa/v1";
pub use matmul::{QMatrix, WeightType};
pub use pool::ThreadPool;

/// Errors from kernel entry points whose shapes come from outside (model files, peers).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KernelError {
    /// A buffer's length does not match the shape it is used with.
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
}
