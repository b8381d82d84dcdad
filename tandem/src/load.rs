//! Opening a model (GGUF file or HF safetensors directory) with its tokenizer.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use engine::model::Model;
use engine::tokenizer::Tokenizer;
use engine::weights::Weights;

/// Resolves `--model`, defaulting to the cached SmolLM2 file.
pub fn model_path(arg: Option<PathBuf>) -> Result<PathBuf> {
    let p = arg.unwrap_or_else(engine::paths::default_model_path);
    if !p.exists() {
        bail!("model {} not found (run `make model` to fetch the default model, or pass --model)", p.display());
    }
    Ok(p)
}

/// Loads weights and tokenizer from a GGUF file or a safetensors directory.
pub fn load(path: &Path, threads: usize) -> Result<(Model, Tokenizer)> {
    let (weights, tokenizer) = if path.is_dir() {
        let w =
            Weights::from_safetensors(path).with_context(|| format!("loading safetensors model {}", path.display()))?;
        let cfg = path.join("tokenizer_config.json");
        let t = Tokenizer::from_files(&path.join("tokenizer.json"), cfg.exists().then_some(cfg.as_path()))
            .with_context(|| format!("loading tokenizer from {}", path.display()))?;
        (w, t)
    } else {
        let (w, f) = Weights::from_gguf(path).with_context(|| format!("loading model {}", path.display()))?;
        let t = Tokenizer::from_gguf(&f).with_context(|| format!("loading tokenizer from {}", path.display()))?;
        (w, t)
    };
    let model = Model::new(weights, threads).context("preparing model")?;
    Ok((model, tokenizer))
}

/// Default thread count: every core the process may use.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
