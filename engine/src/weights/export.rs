//! Writing loaded [`Weights`] out as a Hugging Face Llama checkpoint.
//!
//! The output is what transformers' `save_pretrained` would write for the
//! same model: `model.safetensors` with HF tensor names, `config.json`,
//! `generation_config.json`, `tokenizer.json` and `tokenizer_config.json`.
//! Every tensor is dequantized (whatever its type: Q4_1, Q8_0, F16, ...) and
//! stored as F32 — exact — or BF16; Q and K rows go back to transformers'
//! `rotate_half` layout, the inverse of what the loader does, so
//! [`Weights::from_safetensors`] on the result gives the same model.
//!
//! Tensors are streamed row by row, so memory stays at one row whatever the
//! model size. Each file is written under a temporary name, synced, and
//! renamed into place only when all of them are complete: a failed export
//! leaves the directory's previous files as they were.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::hf::{gguf_row_of_hf, hf_name, llama_tensors, rope_heads};
use super::safetensors::{encode_header, Dtype, TensorSpec};
use super::{Weights, WeightsError};
use crate::tokenizer::{Tokenizer, TokenizerError};

/// The element type of an exported checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExportDtype {
    /// Exact: every dequantized weight is an f32 already.
    F32,
    /// Half the size; each weight rounded to nearest-even bf16.
    BF16,
}

impl From<ExportDtype> for Dtype {
    fn from(d: ExportDtype) -> Self {
        match d {
            ExportDtype::F32 => Dtype::F32,
            ExportDtype::BF16 => Dtype::BF16,
        }
    }
}

impl ExportDtype {
    fn dtype(self) -> Dtype {
        self.into()
    }

    /// The `torch_dtype` transformers records in config.json.
    fn torch_name(self) -> &'static str {
        match self {
            Self::F32 => "float32",
            Self::BF16 => "bfloat16",
        }
    }
}

/// Exports `weights` and `tokenizer` as an HF Llama checkpoint in `out_dir`
/// (created if needed; files of the same names are replaced).
pub fn export_safetensors(
    weights: &Weights,
    tokenizer: &Tokenizer,
    out_dir: &Path,
    dtype: ExportDtype,
) -> Result<(), WeightsError> {
    let cfg = &weights.config;
    if cfg.rope_dims != cfg.head_dim {
        // transformers' Llama rotates whole heads; it has no key for partial RoPE.
        return Err(WeightsError::Safetensors(format!(
            "cannot export: RoPE covers {} of {} head dimensions, which an HF Llama config cannot express",
            cfg.rope_dims, cfg.head_dim
        )));
    }
    std::fs::create_dir_all(out_dir).map_err(|source| WeightsError::Io { path: out_dir.to_owned(), source })?;
    let mut staged = Staged { files: Vec::new() };

    let path = staged.add(out_dir, "model.safetensors");
    write_model(weights, dtype, &path)?;
    let path = staged.add(out_dir, "config.json");
    write_json(&path, &config_json(weights, tokenizer, dtype))?;
    let path = staged.add(out_dir, "generation_config.json");
    let generation = json!({ "bos_token_id": tokenizer.bos_id(), "eos_token_id": tokenizer.eos_ids() });
    write_json(&path, &generation)?;
    let path = staged.add(out_dir, "tokenizer.json");
    tokenizer.save_json(&path).map_err(tokenizer_err)?;
    sync(&path)?;
    let path = staged.add(out_dir, "tokenizer_config.json");
    write_json(&path, &tokenizer.tokenizer_config_json())?;
    staged.commit()
}

/// Streams every tensor, dequantized and in HF row order, into `path`.
fn write_model(weights: &Weights, dtype: ExportDtype, path: &Path) -> Result<(), WeightsError> {
    let cfg = &weights.config;
    let mut specs = Vec::new();
    let mut names = Vec::new();
    for (name, dims) in llama_tensors(cfg) {
        let t = weights.get(&name)?;
        if t.dims != dims {
            return Err(WeightsError::Shape { name, expected: dims, found: t.dims.clone() });
        }
        let hf = hf_name(&name).ok_or_else(|| WeightsError::Missing(name.clone()))?;
        specs.push(TensorSpec { name: hf, dtype: dtype.dtype(), shape: dims });
        names.push(name);
    }
    let meta = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    let header = encode_header(&specs, &meta).map_err(|e| WeightsError::Safetensors(e.to_string()))?;

    let io = |source| WeightsError::Io { path: path.to_owned(), source };
    let file = File::create(path).map_err(io)?;
    let mut out = BufWriter::with_capacity(1 << 20, file);
    out.write_all(&header).map_err(io)?;
    for name in &names {
        write_tensor(weights, name, dtype, &mut out).map_err(|e| match e {
            TensorWriteError::Io(source) => io(source),
            TensorWriteError::Weights(e) => e,
        })?;
    }
    let file = out.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)
}

enum TensorWriteError {
    Io(std::io::Error),
    Weights(WeightsError),
}

/// One tensor, row by row: dequantized to f32, written in `dtype`.
fn write_tensor(
    weights: &Weights,
    name: &str,
    dtype: ExportDtype,
    out: &mut impl Write,
) -> Result<(), TensorWriteError> {
    let t = weights.get(name).map_err(TensorWriteError::Weights)?;
    let (rows, cols) = match t.dims.as_slice() {
        [n] => (1, *n),
        [r, c] => (*r, *c),
        _ => (0, 0),
    };
    let row_bytes = t.ty.row_bytes(cols);
    let shape_err = |why: &str| {
        TensorWriteError::Weights(WeightsError::Shape {
            name: format!("{name} ({why})"),
            expected: t.dims.clone(),
            found: t.dims.clone(),
        })
    };
    if rows == 0 || cols % t.ty.block_elems() != 0 || rows.checked_mul(row_bytes) != Some(t.len) {
        return Err(shape_err(&format!("{:?} data of {} bytes does not fit", t.ty, t.len)));
    }
    // Q and K rows go back to transformers' rotate_half layout.
    let head_dim = match rope_heads(name, &weights.config) {
        Some(n_head) if n_head > 0 && rows % n_head == 0 && (rows / n_head) % 2 == 0 => Some(rows / n_head),
        Some(_) => return Err(shape_err("rows do not split into RoPE heads")),
        None => None,
    };
    let data = weights.bytes(t);
    let mut values = vec![0f32; cols];
    let mut bytes = Vec::with_capacity(cols * dtype.dtype().size());
    for r in 0..rows {
        let src = head_dim.map_or(r, |hd| gguf_row_of_hf(r, hd));
        let row = data.get(src * row_bytes..(src + 1) * row_bytes).ok_or_else(|| shape_err("row outside the data"))?;
        kernels::quant::dequantize_row(t.ty, row, &mut values);
        bytes.clear();
        match dtype {
            ExportDtype::F32 => values.iter().for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
            ExportDtype::BF16 => {
                values.iter().for_each(|&v| bytes.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes()))
            }
        }
        out.write_all(&bytes).map_err(TensorWriteError::Io)?;
    }
    Ok(())
}

/// config.json as transformers' LlamaConfig writes it.
fn config_json(weights: &Weights, tokenizer: &Tokenizer, dtype: ExportDtype) -> Value {
    let c = &weights.config;
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden,
        "intermediate_size": c.ffn,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "num_hidden_layers": c.n_layers,
        "head_dim": c.head_dim,
        "rms_norm_eps": short_f32(c.rms_eps),
        "rope_theta": short_f32(c.rope_theta),
        "rope_scaling": null,
        "max_position_embeddings": c.context,
        "vocab_size": c.vocab,
        "tie_word_embeddings": c.tied_embeddings,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "bos_token_id": tokenizer.bos_id(),
        "eos_token_id": tokenizer.eos_id(),
        "torch_dtype": dtype.torch_name(),
    })
}

/// An f32 as the shortest decimal that reads back to it (`1e-5`, not
/// `9.999999747378752e-6`), so config.json looks as a person would write it.
fn short_f32(x: f32) -> Value {
    x.to_string().parse::<f64>().ok().and_then(serde_json::Number::from_f64).map_or(Value::Null, Value::Number)
}

fn write_json(path: &Path, value: &Value) -> Result<(), WeightsError> {
    let io = |source| WeightsError::Io { path: path.to_owned(), source };
    let text = serde_json::to_string_pretty(value).map_err(|e| io(e.into()))?;
    std::fs::write(path, text + "\n").map_err(io)?;
    sync(path)
}

/// Flushes a written file to disk, so the rename that publishes it cannot
/// survive a crash that its contents did not.
fn sync(path: &Path) -> Result<(), WeightsError> {
    File::open(path).and_then(|f| f.sync_all()).map_err(|source| WeightsError::Io { path: path.to_owned(), source })
}

fn tokenizer_err(e: TokenizerError) -> WeightsError {
    match e {
        TokenizerError::Io { path, source } => WeightsError::Io { path, source },
        other => WeightsError::Safetensors(format!("tokenizer: {other}")),
    }
}

/// Files written under temporary names, renamed into place by [`Staged::commit`]
/// and removed if the export fails before that.
struct Staged {
    /// (temporary, final) paths.
    files: Vec<(PathBuf, PathBuf)>,
}

impl Staged {
    /// Registers `name` in `dir` and returns the temporary path to write it at.
    fn add(&mut self, dir: &Path, name: &str) -> PathBuf {
        let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
        self.files.push((tmp.clone(), dir.join(name)));
        tmp
    }

    /// Renames every file into place. If one rename fails, drop removes the
    /// temporaries not yet renamed.
    fn commit(mut self) -> Result<(), WeightsError> {
        for (tmp, dst) in &self.files {
            std::fs::rename(tmp, dst).map_err(|source| WeightsError::Io { path: dst.clone(), source })?;
        }
        self.files.clear();
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        for (tmp, _) in &self.files {
            // Best effort: the file may never have been created.
            let _ = std::fs::remove_file(tmp);
        }
    }
}
