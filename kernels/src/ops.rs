//! Element-wise and per-row ops: RMSNorm, RoPE, SwiGLU, softmax.
//!
//! These touch a few hundred floats per token and are memory-trivial next
//! to the matmuls; plain Rust that the compiler vectorises is fast enough,
//! so they have a single implementation.

/// `out = x / rms(x) * weight`, per row of `weight.len()` elements.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (xr, or) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        // Squares summed in f64, as ggml does: the model's large activation
        // outliers make this sum the least precise step of the norm.
        let ss = (xr.iter().map(|v| (v * v) as f64).sum::<f64>() / n as f64) as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, v), w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// Precomputed RoPE rotation table: `cos`/`sin` for every position below
/// `max_pos` and every rotated pair of a head.
#[derive(Debug, Clone)]
pub struct RopeTable {
    head_dim: usize,
    half: usize,
    max_pos: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// Llama's "normal" rotation: pairs are (2i, 2i+1), the layout of GGUF
    /// Llama files (their converter permutes Q/K weights to match). Only the
    /// first `rope_dims` of each head rotate.
    pub fn new(head_dim: usize, rope_dims: usize, theta: f32, max_pos: usize) -> Self {
        let half = rope_dims.min(head_dim) / 2;
        let mut cos = vec![0f32; max_pos * half];
        let mut sin = vec![0f32; max_pos * half];
        // Angles as ggml computes them — in f32, each frequency the previous
        // one times base^(-2/dims) — so rotations match the reference
        // implementation to the last bit rather than merely to f32 precision.
        let step = theta.powf(-2.0 / (2 * half) as f32);
        for p in 0..max_pos {
            let mut a = p as f32;
            for i in 0..half {
                cos[p * half + i] = a.cos();
                sin[p * half + i] = a.sin();
                a *= step;
            }
        }
        Self { head_dim, half, max_pos, cos, sin }
    }

    /// Positions this table covers.
    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// Rotates every head of one token's `x` (`n_heads * head_dim`) in place
    /// for position `pos` (< `max_pos`).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.half;
        let c = &self.cos[pos * half..(pos + 1) * half];
        let s = &self.sin[pos * half..(pos + 1) * half];
        for head in x.chunks_exact_mut(self.head_dim) {
            for i in 0..half {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c[i] - b * s[i];
                head[2 * i + 1] = a * s[i] + b * c[i];
            }
        }
    }
}

/// `gate = silu(gate) * up`, in place on `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// In-place softmax.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// `x += y`.
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
