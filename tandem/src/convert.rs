//! `tandem convert`: GGUF -> HF safetensors (dequantized), e.g. to test the
//! safetensors loader with real weights or to hand a model to other tools.

use std::path::PathBuf;

use anyhow::{Context, Result};
use engine::weights::export::{export_safetensors, ExportDtype};

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (default: the cached SmolLM2 file).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Output directory (created; files of the same names are replaced).
    #[arg(long)]
    out: PathBuf,
    /// Element type of the written tensors.
    #[arg(long, value_parser = ["f32", "bf16"], default_value = "bf16")]
    dtype: String,
}

pub fn run(a: Args) -> Result<()> {
    let path = crate::load::model_path(a.model)?;
    let (weights, file) =
        engine::weights::Weights::from_gguf(&path).with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = engine::tokenizer::Tokenizer::from_gguf(&file).context("loading tokenizer")?;
    let dtype = if a.dtype == "f32" { ExportDtype::F32 } else { ExportDtype::BF16 };
    export_safetensors(&weights, &tokenizer, &a.out, dtype).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!("wrote {} ({})", a.out.display(), a.dtype);
    Ok(())
}
