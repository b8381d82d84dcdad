//! `tandem generate`: one request through the engine, streamed to stdout.

#![allow(clippy::disallowed_types, reason = "`--stats` reports wall time on purpose")]

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::batch::{Engine, EngineConfig, Request};
use engine::sampler::StopChecker;
use engine::tokenizer::{ChatMessage, IncrementalDecoder};
use types::kv::KvDtype;
use types::sampling::SamplingParams;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "chat"])), allow_negative_numbers = true)]
pub struct Args {
    /// Model: a GGUF file or an HF safetensors directory (default: the cached SmolLM2 file).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Raw prompt text, continued as is (special tokens like <|im_start|> are parsed).
    #[arg(long)]
    prompt: Option<String>,
    /// One user message, wrapped in the model's chat template with the generation prompt.
    #[arg(long)]
    chat: Option<String>,
    /// Maximum tokens to generate (>= 1).
    #[arg(long, default_value_t = 256)]
    max_tokens: u32,
    /// Sampling temperature; 0 is greedy (the default, reproducible).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Random seed for reproducible sampling: token n is drawn at (seed, n), so the
    /// same seed gives the same answer here and through a cluster.
    #[arg(long)]
    seed: Option<u64>,
    /// Presence penalty in [-2, 2] (OpenAI semantics).
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Frequency penalty in [-2, 2] (OpenAI semantics).
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Repetition penalty, > 0 (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Instead of the text, print one JSON line per generated token: its id, its
    /// vocabulary piece and its logprob (for comparing answers token by token).
    #[arg(long)]
    tokens: bool,
    /// Stop when this text is generated (repeatable); it is not printed.
    #[arg(long)]
    stop: Vec<String>,
    /// Compute threads (default: all available cores).
    #[arg(long, env = "TANDEM_THREADS")]
    threads: Option<usize>,
    /// KV cache element type.
    #[arg(long, default_value = "f16", value_parser = ["f16", "f32"])]
    kv_dtype: String,
    /// Prompt-lookup speculation: draft tokens per step copied from the prompt and the
    /// text so far, checked in the same forward pass (0 = off). The output is the same.
    #[arg(long, default_value_t = 0)]
    prompt_lookup: usize,
    /// Print one JSON line of timing statistics on stderr at the end.
    #[arg(long)]
    stats: bool,
}

#[derive(serde::Serialize)]
struct Stats {
    prompt_tokens: usize,
    prefill_ms: f64,
    generated_tokens: usize,
    decode_ms: f64,
    threads: usize,
    /// Prompt-lookup draft tokens computed and accepted.
    draft_tokens: u64,
    accepted_draft_tokens: u64,
}

pub fn run(a: Args) -> Result<()> {
    if a.threads == Some(0) {
        bail!("--threads must be at least 1");
    }
    let params = SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        max_tokens: a.max_tokens,
        stop_strings: a.stop.clone(),
        presence_penalty: a.presence_penalty,
        frequency_penalty: a.frequency_penalty,
        repetition_penalty: a.repetition_penalty,
        ignore_eos: a.ignore_eos,
        logprobs: a.tokens.then_some(0),
        ..SamplingParams::default()
    };
    params.validate().context("invalid sampling options")?;
    let threads = a.threads.unwrap_or_else(crate::load::default_threads);
    let path = crate::load::model_path(a.model)?;
    let (model, tok) = crate::load::load(&path, threads)?;

    let text = match (&a.prompt, &a.chat) {
        (Some(p), _) => p.clone(),
        (None, Some(c)) => tok
            .apply_chat_template(&[ChatMessage::new("user", c.as_str())], true)
            .context("rendering the chat template")?,
        (None, None) => bail!("one of --prompt or --chat is required"),
    };
    let prompt = tok.encode(&text, true).context("tokenizing the prompt")?;
    // Engine::add validates the prompt (length vs context, vocabulary).
    let context = model.config().context;

    let block_size = 16;
    let total = (prompt.len() + a.max_tokens as usize).min(context);
    let cfg = EngineConfig {
        block_size,
        kv_dtype: KvDtype::parse(&a.kv_dtype).unwrap_or(KvDtype::F16),
        kv_blocks: total.div_ceil(block_size) + 1,
        max_batch_tokens: 512,
        max_running: 1,
        prefix_cache: false,
        max_decode_stall_ms: None,
        prompt_lookup: a.prompt_lookup,
    };
    let mut engine = Engine::new(model, cfg, tok.eos_ids().to_vec())?;
    engine.add(Request {
        id: 0,
        prompt: prompt.clone(),
        params: params.clone(),
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    })?;

    let mut stop = StopChecker::new(&params, tok.eos_ids())?;
    let mut detok = IncrementalDecoder::new();
    let mut out = std::io::stdout().lock();
    let started = Instant::now();
    let mut first_token_at = None;
    let mut generated = 0usize;
    let mut finished = false;
    while engine.has_work() && !finished {
        for ev in engine.step()? {
            first_token_at.get_or_insert_with(Instant::now);
            generated += 1;
            let piece = detok.push(&tok, ev.token.id)?;
            let d = stop.on_token(ev.token.id, &piece);
            if a.tokens {
                let line = serde_json::json!({
                    "id": ev.token.id,
                    "token": tok.token_piece(ev.token.id).unwrap_or_default(),
                    "logprob": ev.token.logprob,
                });
                writeln!(out, "{line}")?;
            } else {
                out.write_all(d.emit.as_bytes())?;
            }
            out.flush()?;
            if d.finished.is_some() || ev.finished.is_some() {
                // A step can carry several tokens (prompt lookup): none after the end.
                finished = true;
                break;
            }
        }
    }
    engine.abort(0);
    if a.tokens {
        return Ok(());
    }
    if !stop.finish_reason().is_some_and(|r| r == engine::sampler::FinishReason::Stop) {
        let rest = detok.finish(&tok)?;
        let d = stop.push_text(&rest);
        out.write_all(d.emit.as_bytes())?;
        out.write_all(stop.flush().as_bytes())?;
    }
    out.write_all(b"\n")?;
    out.flush()?;

    if a.stats {
        let first = first_token_at.unwrap_or_else(Instant::now);
        let s = Stats {
            prompt_tokens: prompt.len(),
            prefill_ms: (first - started).as_secs_f64() * 1e3,
            generated_tokens: generated,
            decode_ms: first.elapsed().as_secs_f64() * 1e3,
            threads,
            draft_tokens: engine.draft_tokens().0,
            accepted_draft_tokens: engine.draft_tokens().1,
        };
        eprintln!("{}", serde_json::to_string(&s)?);
    }
    Ok(())
}
