//! Llama-family hyper-parameters, read from the model file — never assumed.

use crate::gguf::{GgufError, GgufFile};

/// Hyper-parameters of a Llama-architecture model.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LlamaConfig {
    pub n_layers: usize,
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub context: usize,
    pub rope_theta: f32,
    pub rope_dims: usize,
    pub rms_eps: f32,
    /// The output head reuses the token embedding matrix.
    pub tied_embeddings: bool,
}

impl LlamaConfig {
    /// Reads `llama.*` keys. Architectures other than `llama` are refused:
    /// loading them with Llama math would produce fluent garbage.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, GgufError> {
        let arch = f.require_str("general.architecture")?;
        if arch != "llama" {
            return Err(GgufError::Metadata {
                key: "general.architecture".into(),
                why: format!("unsupported architecture {arch:?} (supported: llama)"),
            });
        }
        let u = |k: &str| -> Result<usize, GgufError> { Ok(f.require_u64(&format!("llama.{k}"))? as usize) };
        let hidden = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let n_kv_heads = match f.meta("llama.attention.head_count_kv") {
            Some(v) => v.as_u64().ok_or_else(|| GgufError::Metadata {
                key: "llama.attention.head_count_kv".into(),
                why: "expected an integer".into(),
            })? as usize,
            None => n_heads,
        };
        let vocab = match f.meta("llama.vocab_size").and_then(|v| v.as_u64()) {
            Some(v) => v as usize,
            None => f.str_array("tokenizer.ggml.tokens")?.len(),
        };
        let head_dim = hidden.checked_div(n_heads).unwrap_or(0);
        let rope_dims = match f.meta("llama.rope.dimension_count").and_then(|v| v.as_u64()) {
            Some(v) => v as usize,
            None => head_dim,
        };
        let cfg = Self {
            n_layers: u("block_count")?,
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn: u("feed_forward_length")?,
            vocab,
            context: u("context_length")?,
            rope_theta: f.meta("llama.rope.freq_base").and_then(|v| v.as_f64()).unwrap_or(10_000.0) as f32,
            rope_dims,
            rms_eps: f.require_f64("llama.attention.layer_norm_rms_epsilon")? as f32,
            tied_embeddings: f.tensor("output.weight").is_none(),
        };
        cfg.validate().map_err(|why| GgufError::Metadata { key: "llama.*".into(), why })?;
        Ok(cfg)
    }

    /// Shape sanity, so a hostile file cannot make the forward pass index out of bounds.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("block_count", self.n_layers),
            ("embedding_length", self.hidden),
            ("head_count", self.n_heads),
            ("head_count_kv", self.n_kv_heads),
            ("feed_forward_length", self.ffn),
            ("vocab_size", self.vocab),
            ("context_length", self.context),
        ];
        for (k, v) in positive {
            if v == 0 {
                return Err(format!("{k} must be positive"));
            }
        }
        if self.hidden % self.n_heads != 0 || self.n_heads % self.n_kv_heads != 0 {
            return Err(format!(
                "embedding_length {} / head_count {} / head_count_kv {} do not divide",
                self.hidden, self.n_heads, self.n_kv_heads
            ));
        }
        if self.rope_dims > self.head_dim || self.rope_dims % 2 != 0 {
            return Err(format!("rope dimension_count {} invalid for head_dim {}", self.rope_dims, self.head_dim));
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0 && self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err("rms epsilon and rope theta must be positive and finite".into());
        }
        if self.n_layers > 1024 || self.hidden > 1 << 16 || self.vocab > 1 << 22 || self.context > 1 << 22 {
            return Err("implausibly large model dimensions".into());
        }
        Ok(())
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use crate::gguf::tests::Builder;
    use crate::gguf::GgufFile;

    fn open(bytes: Vec<u8>) -> Result<super::LlamaConfig, crate::gguf::GgufError> {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("tandem-cfg-{}-{n}", std::process::id()));
        std::fs::write(&dir, bytes).expect("write");
        let f = GgufFile::open(&dir);
        let _ = std::fs::remove_file(&dir);
        super::LlamaConfig::from_gguf(&f?)
    }

    #[test]
    fn unknown_architecture_is_refused() {
        let err = open(Builder::new().str("general.architecture", "gpt2").build()).expect_err("gpt2 is not llama");
        assert!(err.to_string().contains("unsupported architecture \"gpt2\""), "{err}");
    }

    #[test]
    fn missing_and_inconsistent_hyperparameters_are_named() {
        let err = open(Builder::new().str("general.architecture", "llama").build()).expect_err("no keys");
        assert!(err.to_string().contains("llama."), "{err}");
        let b = Builder::new()
            .str("general.architecture", "llama")
            .u32("llama.block_count", 2)
            .u32("llama.embedding_length", 100)
            .u32("llama.attention.head_count", 7)
            .u32("llama.feed_forward_length", 64)
            .u32("llama.context_length", 128)
            .u32("llama.vocab_size", 10)
            .build();
        let err = open(b).expect_err("100 is not divisible by 7");
        assert!(err.to_string().contains("do not divide") || err.to_string().contains("epsilon"), "{err}");
    }
}
