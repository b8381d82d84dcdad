//! Hugging Face Llama checkpoints: `config.json`, tensor names, and the Q/K
//! row order.
//!
//! A directory as transformers writes it (`config.json` plus
//! `model.safetensors`, or shards listed in `model.safetensors.index.json`)
//! loads into the same [`Weights`] a GGUF file does. Tensors keep their
//! float type (F32, F16 or BF16, all of which the matmul reads directly) and
//! are renamed to GGUF's canonical names.
//!
//! Q and K rows are reordered on the way in. transformers applies RoPE with
//! `rotate_half`, pairing element `i` of a head with `i + head_dim/2`; the
//! engine's kernel (like GGUF files, whose converter permutes the weights)
//! pairs `2i` with `2i + 1`. Reordering the rows of `W_q` and `W_k` turns one
//! layout into the other without touching the forward pass, and since Q and
//! K move alike within each head, attention scores are unchanged.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::safetensors::parse_header;
use super::{Backing, TensorRef, Weights, WeightsError};
use crate::model::LlamaConfig;

/// Per-layer tensors: HF name after `model.layers.N.`, GGUF name after `blk.N.`.
const LAYER_NAMES: [(&str, &str); 9] = [
    ("input_layernorm", "attn_norm"),
    ("self_attn.q_proj", "attn_q"),
    ("self_attn.k_proj", "attn_k"),
    ("self_attn.v_proj", "attn_v"),
    ("self_attn.o_proj", "attn_output"),
    ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "ffn_gate"),
    ("mlp.up_proj", "ffn_up"),
    ("mlp.down_proj", "ffn_down"),
];

/// Model-wide tensors, HF and GGUF names without `.weight`.
const GLOBAL_NAMES: [(&str, &str); 3] =
    [("model.embed_tokens", "token_embd"), ("model.norm", "output_norm"), ("lm_head", "output")];

/// What is wrong with an HF checkpoint besides its safetensors bytes.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CheckpointError {
    /// config.json is not a JSON object.
    #[error("config.json is not a JSON object: {0}")]
    ConfigJson(String),
    /// A config.json key is missing or has the wrong type or value.
    #[error("config.json key {key:?}: {why}")]
    ConfigKey { key: &'static str, why: String },
    /// The checkpoint is not a Llama model.
    #[error(
        "unsupported architecture {architectures:?} / model_type {model_type:?} (supported: LlamaForCausalLM, llama)"
    )]
    UnsupportedArchitecture { architectures: Vec<String>, model_type: Option<String> },
    /// A config.json feature the forward pass does not implement (rope
    /// scaling, biases, another activation): loading would give fluent garbage.
    #[error("config.json {key:?} = {value} is not supported")]
    UnsupportedFeature { key: &'static str, value: String },
    /// The hyper-parameters are inconsistent (see [`LlamaConfig::validate`]).
    #[error("config.json: {0}")]
    InvalidConfig(String),
    /// A tensor name that is not part of a Llama model of this config.
    #[error("unexpected tensor {0:?}")]
    UnexpectedTensor(String),
    /// Two tensors (possibly in different shards) map to the same weight.
    #[error("tensor {0:?} appears twice")]
    DuplicateTensor(String),
    /// A Q or K matrix whose rows do not split into heads of even size.
    #[error("cannot reorder {rows} rows ({bytes} bytes) as {n_head} RoPE heads")]
    BadQkShape { rows: usize, n_head: usize, bytes: usize },
    /// model.safetensors.index.json is malformed or names a shard outside the directory.
    #[error("model.safetensors.index.json: {0}")]
    BadIndex(String),
}

/// The canonical (GGUF) name of an HF Llama tensor, or `None` if the name
/// is not one of a Llama model's weights.
pub fn gguf_name(hf: &str) -> Option<String> {
    let stem = hf.strip_suffix(".weight")?;
    if let Some(rest) = stem.strip_prefix("model.layers.") {
        let (layer, part) = rest.split_once('.')?;
        // Digits only: `usize::from_str` would also take "+3", a second spelling of layer 3.
        if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let layer: usize = layer.parse().ok()?;
        let (_, g) = LAYER_NAMES.iter().find(|(h, _)| *h == part)?;
        return Some(format!("blk.{layer}.{g}.weight"));
    }
    GLOBAL_NAMES.iter().find(|(h, _)| *h == stem).map(|(_, g)| format!("{g}.weight"))
}

/// The HF name of a canonical (GGUF) tensor name; the inverse of [`gguf_name`].
pub fn hf_name(gguf: &str) -> Option<String> {
    let stem = gguf.strip_suffix(".weight")?;
    if let Some(rest) = stem.strip_prefix("blk.") {
        let (layer, part) = rest.split_once('.')?;
        if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let (h, _) = LAYER_NAMES.iter().find(|(_, g)| *g == part)?;
        return Some(format!("model.layers.{layer}.{h}.weight"));
    }
    GLOBAL_NAMES.iter().find(|(_, g)| *g == stem).map(|(h, _)| format!("{h}.weight"))
}

/// Every tensor a Llama model of `cfg` needs, canonical name and dims
/// (`output.weight` only when the embeddings are not tied), in a fixed order.
pub fn llama_tensors(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (h, kvd, ffn) = (cfg.hidden, cfg.kv_dim(), cfg.ffn);
    let mut out = vec![("token_embd.weight".to_owned(), vec![cfg.vocab, h])];
    for l in 0..cfg.n_layers {
        let dims = [
            vec![h],
            vec![h, h],
            vec![kvd, h],
            vec![kvd, h],
            vec![h, h],
            vec![h],
            vec![ffn, h],
            vec![ffn, h],
            vec![h, ffn],
        ];
        for ((_, g), d) in LAYER_NAMES.iter().zip(dims) {
            out.push((format!("blk.{l}.{g}.weight"), d));
        }
    }
    out.push(("output_norm.weight".to_owned(), vec![h]));
    if !cfg.tied_embeddings {
        out.push(("output.weight".to_owned(), vec![cfg.vocab, h]));
    }
    out
}

/// The head count whose heads a Q or K matrix is made of, or `None` for
/// tensors whose rows need no reordering.
pub fn rope_heads(gguf_name: &str, cfg: &LlamaConfig) -> Option<usize> {
    if gguf_name.ends_with(".attn_q.weight") {
        Some(cfg.n_heads)
    } else if gguf_name.ends_with(".attn_k.weight") {
        Some(cfg.n_kv_heads)
    } else {
        None
    }
}

/// Which way [`permute_qk`] reorders rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkOrder {
    /// From transformers' `rotate_half` layout to GGUF's interleaved pairs.
    HfToGguf,
    /// Back again, for export.
    GgufToHf,
}

/// The HF row that row `r` of a GGUF-layout Q/K matrix comes from.
///
/// llama.cpp's converter computes the GGUF matrix as
/// `w.reshape(n_head, 2, head_dim/2, cols).swapaxes(1, 2).reshape(rows, cols)`:
/// within a head, GGUF row `2i + j` is HF row `j * head_dim/2 + i`.
pub fn hf_row_of_gguf(r: usize, head_dim: usize) -> usize {
    let (head, i) = (r / head_dim, r % head_dim);
    head * head_dim + (i % 2) * (head_dim / 2) + i / 2
}

/// The GGUF row that row `r` of an HF-layout Q/K matrix goes to; the
/// inverse of [`hf_row_of_gguf`].
pub fn gguf_row_of_hf(r: usize, head_dim: usize) -> usize {
    let (head, i) = (r / head_dim, r % head_dim);
    let half = head_dim / 2;
    head * head_dim + (i % half) * 2 + i / half
}

/// Reorders the `rows` rows of a Q or K matrix made of `n_head` heads.
/// `bytes` is the whole matrix; rows may hold any element type.
pub fn permute_qk(bytes: &[u8], rows: usize, n_head: usize, order: QkOrder) -> Result<Vec<u8>, CheckpointError> {
    let mut out = vec![0u8; bytes.len()];
    permute_into(bytes, &mut out, rows, n_head, order)?;
    Ok(out)
}

fn permute_into(src: &[u8], dst: &mut [u8], rows: usize, n_head: usize, order: QkOrder) -> Result<(), CheckpointError> {
    let bad = || CheckpointError::BadQkShape { rows, n_head, bytes: src.len() };
    if rows == 0
        || n_head == 0
        || src.len() % rows != 0
        || rows % n_head != 0
        || (rows / n_head) % 2 != 0
        || dst.len() != src.len()
    {
        return Err(bad());
    }
    let (row_bytes, head_dim) = (src.len() / rows, rows / n_head);
    for (r, out) in dst.chunks_exact_mut(row_bytes).enumerate() {
        let from = match order {
            QkOrder::HfToGguf => hf_row_of_gguf(r, head_dim),
            QkOrder::GgufToHf => gguf_row_of_hf(r, head_dim),
        };
        out.copy_from_slice(src.get(from * row_bytes..(from + 1) * row_bytes).ok_or_else(bad)?);
    }
    Ok(())
}

impl Weights {
    /// Loads an HF Llama checkpoint directory: `config.json` and
    /// `model.safetensors` (or the shards `model.safetensors.index.json`
    /// lists). Tensors are copied into memory in their file's float type,
    /// renamed to canonical names and, for Q and K, reordered to GGUF rows.
    pub fn from_safetensors(dir: &Path) -> Result<Weights, WeightsError> {
        let config_path = dir.join("config.json");
        let config = config_from_json(&read(&config_path)?).map_err(|e| checkpoint_err(&config_path, e))?;
        let expected: HashMap<String, Vec<usize>> = llama_tensors(&config).into_iter().collect();

        // All shards end to end in one buffer; a single file is used as read.
        let mut backing: Vec<u8> = Vec::new();
        let mut tensors: HashMap<String, TensorRef> = HashMap::with_capacity(expected.len());
        for path in shard_files(dir)? {
            let bytes = read(&path)?;
            let header = parse_header(&bytes).map_err(|e| checkpoint_err(&path, e))?;
            let base = backing.len();
            if backing.is_empty() {
                backing = bytes;
            } else {
                backing.extend_from_slice(&bytes);
            }
            for (hf, info) in header.tensors {
                let name = match gguf_name(&hf) {
                    // Older checkpoints store RoPE frequencies; the engine computes them.
                    None if hf.ends_with(".rotary_emb.inv_freq") => continue,
                    // transformers re-ties a stored lm_head to the embeddings, and so does the engine.
                    Some(name) if name == "output.weight" && config.tied_embeddings => continue,
                    Some(name) if expected.contains_key(&name) => name,
                    _ => return Err(checkpoint_err(&path, CheckpointError::UnexpectedTensor(hf))),
                };
                if expected.get(&name) != Some(&info.shape) {
                    let want = expected.get(&name).cloned().unwrap_or_default();
                    return Err(WeightsError::Shape { name: hf, expected: want, found: info.shape });
                }
                let t = TensorRef {
                    ty: info.dtype.weight_type(),
                    dims: info.shape,
                    offset: base + info.range.start,
                    len: info.range.len(),
                };
                if tensors.insert(name, t).is_some() {
                    return Err(checkpoint_err(&path, CheckpointError::DuplicateTensor(hf)));
                }
            }
        }
        let mut missing: Vec<&String> = expected.keys().filter(|n| !tensors.contains_key(*n)).collect();
        missing.sort();
        if let Some(name) = missing.first() {
            return Err(WeightsError::Missing(hf_name(name).unwrap_or_else(|| name.to_string())));
        }

        for (name, t) in &tensors {
            if let Some(n_head) = rope_heads(name, &config) {
                let bad = |why: &dyn std::fmt::Display| checkpoint_err(dir, format!("{name}: {why}"));
                let Some(region) = backing.get_mut(t.offset..t.offset + t.len) else {
                    return Err(bad(&"data outside the file"));
                };
                let hf_rows = region.to_vec();
                let rows = t.dims.first().copied().unwrap_or(0);
                permute_into(&hf_rows, region, rows, n_head, QkOrder::HfToGguf).map_err(|e| bad(&e))?;
            }
        }
        Ok(Weights { backing: Backing::Owned(backing), tensors, config, panels: Default::default() })
    }
}

/// The safetensors files of a checkpoint: `model.safetensors`, else the
/// shards named in `model.safetensors.index.json`, in name order.
fn shard_files(dir: &Path) -> Result<Vec<PathBuf>, WeightsError> {
    let single = dir.join("model.safetensors");
    let index_path = dir.join("model.safetensors.index.json");
    if single.is_file() || !index_path.is_file() {
        // A missing file is reported as the single-file name, the common layout.
        return Ok(vec![single]);
    }
    let bad = |why: String| checkpoint_err(&index_path, CheckpointError::BadIndex(why));
    let index: Value = serde_json::from_slice(&read(&index_path)?).map_err(|e| bad(e.to_string()))?;
    let map =
        index.get("weight_map").and_then(Value::as_object).ok_or_else(|| bad("no object \"weight_map\"".into()))?;
    let mut files = std::collections::BTreeSet::new();
    for file in map.values() {
        let file = file.as_str().ok_or_else(|| bad("weight_map has a non-string file".into()))?;
        // A plain name in this directory: a hostile index must not reach other files.
        let plain = Path::new(file).file_name().is_some_and(|n| n == file) && file != "..";
        if !plain {
            return Err(bad(format!("shard {file:?} is not a file name in the checkpoint directory")));
        }
        files.insert(file);
    }
    if files.is_empty() {
        return Err(bad("weight_map is empty".into()));
    }
    Ok(files.into_iter().map(|f| dir.join(f)).collect())
}

fn read(path: &Path) -> Result<Vec<u8>, WeightsError> {
    std::fs::read(path).map_err(|source| WeightsError::Io { path: path.to_owned(), source })
}

/// A checkpoint error, prefixed with the file it is about.
fn checkpoint_err(path: &Path, e: impl std::fmt::Display) -> WeightsError {
    WeightsError::Safetensors(format!("{}: {e}", path.display()))
}

/// Reads config.json into a [`LlamaConfig`], refusing anything the engine
/// would run wrongly.
pub fn config_from_json(text: &[u8]) -> Result<LlamaConfig, CheckpointError> {
    let json: Map<String, Value> =
        serde_json::from_slice(text).map_err(|e| CheckpointError::ConfigJson(e.to_string()))?;
    let cfg = ConfigJson(&json);

    let architectures: Vec<String> = match json.get("architectures") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect(),
        Some(_) => return Err(cfg.bad("architectures", "not a list")),
    };
    let model_type = cfg.opt_str("model_type")?;
    if !architectures.iter().any(|a| a == "LlamaForCausalLM") && model_type.as_deref() != Some("llama") {
        return Err(CheckpointError::UnsupportedArchitecture { architectures, model_type });
    }
    if let Some(act) = cfg.opt_str("hidden_act")? {
        if act != "silu" {
            return Err(CheckpointError::UnsupportedFeature { key: "hidden_act", value: act });
        }
    }
    for key in ["attention_bias", "mlp_bias"] {
        if cfg.opt_bool(key)? == Some(true) {
            return Err(CheckpointError::UnsupportedFeature { key, value: "true".into() });
        }
    }
    if let Some(v) = json.get("rope_scaling").filter(|v| !v.is_null()) {
        return Err(CheckpointError::UnsupportedFeature { key: "rope_scaling", value: v.to_string() });
    }

    let hidden = cfg.usize("hidden_size")?;
    let n_heads = cfg.usize("num_attention_heads")?;
    // Zero heads is refused by validate() below, naming the key.
    let head_dim = hidden.checked_div(n_heads).unwrap_or(0);
    if let Some(hd) = cfg.opt_usize("head_dim")? {
        // The forward pass derives head_dim from hidden / heads.
        if hd != head_dim {
            return Err(CheckpointError::UnsupportedFeature { key: "head_dim", value: hd.to_string() });
        }
    }
    let out = LlamaConfig {
        n_layers: cfg.usize("num_hidden_layers")?,
        hidden,
        n_heads,
        n_kv_heads: cfg.opt_usize("num_key_value_heads")?.unwrap_or(n_heads),
        head_dim,
        ffn: cfg.usize("intermediate_size")?,
        vocab: cfg.usize("vocab_size")?,
        context: cfg.usize("max_position_embeddings")?,
        // transformers' LlamaConfig defaults.
        rope_theta: cfg.opt_f32("rope_theta")?.unwrap_or(10_000.0),
        rope_dims: head_dim,
        rms_eps: cfg.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
        tied_embeddings: cfg.opt_bool("tie_word_embeddings")?.unwrap_or(false),
    };
    out.validate().map_err(CheckpointError::InvalidConfig)?;
    Ok(out)
}

/// Typed getters over config.json whose errors name the key.
struct ConfigJson<'a>(&'a Map<String, Value>);

impl ConfigJson<'_> {
    fn bad(&self, key: &'static str, why: &str) -> CheckpointError {
        CheckpointError::ConfigKey { key, why: why.to_owned() }
    }

    /// `None` for an absent or null key.
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn opt_usize(&self, key: &'static str) -> Result<Option<usize>, CheckpointError> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.bad(key, "not a non-negative integer"))
            })
            .transpose()
    }

    fn usize(&self, key: &'static str) -> Result<usize, CheckpointError> {
        self.opt_usize(key)?.ok_or_else(|| self.bad(key, "missing"))
    }

    fn opt_f32(&self, key: &'static str) -> Result<Option<f32>, CheckpointError> {
        self.get(key).map(|v| v.as_f64().map(|f| f as f32).ok_or_else(|| self.bad(key, "not a number"))).transpose()
    }

    fn opt_bool(&self, key: &'static str) -> Result<Option<bool>, CheckpointError> {
        self.get(key).map(|v| v.as_bool().ok_or_else(|| self.bad(key, "not a bool"))).transpose()
    }

    fn opt_str(&self, key: &'static str) -> Result<Option<String>, CheckpointError> {
        self.get(key).map(|v| v.as_str().map(str::to_owned).ok_or_else(|| self.bad(key, "not a string"))).transpose()
    }
}

#[cfg(test)]
mod tests;
