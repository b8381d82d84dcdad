//! `tandem bench lookup`: prompt-lookup speculation against plain decoding,
//! in one run, on the engine itself. Two workloads: answers that repeat
//! their prompt (a spelling fix, an extraction, a code edit, a list copied)
//! and answers that do not (open questions). Per round and configuration
//! each prompt is answered alone (greedy, chat template); decode speed is
//! generated tokens after the first over the time from the first token to
//! the last. The answers with speculation must equal plain decoding's, token
//! for token, or the bench fails.

#![allow(clippy::disallowed_types, reason = "a benchmark: wall time on purpose")]

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use engine::batch::{Engine, EngineConfig, Request};
use engine::tokenizer::{ChatMessage, Tokenizer};
use types::sampling::SamplingParams;

use crate::bench::Spread;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (default: the cached SmolLM2 file).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Model compute threads.
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Rounds; each runs both configurations on both workloads.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Draft tokens per step with speculation on (`prompt_lookup`).
    #[arg(long, default_value_t = 8)]
    draft: usize,
    /// Most tokens per answer.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
}

const REPEATING: [&str; 4] = [
    "Correct the spelling mistakes in this text and return the whole corrected text:\n\
     The comittee met on Tuesday to discus the new budjet. Every departmant presented its plans, \
     and the chairman thanked evryone for there hard work before the meeting ended.",
    "Copy every sentence of this text that mentions a colour, word for word:\n\
     The house had a red door. Its garden was large. A blue bench stood under the old tree. \
     Nobody had sat on it for years. The fence was painted white last spring.",
    "Add type hints to this Python function and change nothing else:\n\
     def scale(values, factor):\n    result = []\n    for v in values:\n        result.append(v * factor)\n    return result",
    "Repeat this list exactly, one item per line: apples, bananas, cherries, dates, elderberries, \
     figs, grapes, honeydew melons, kiwis, lemons, mangoes, nectarines, oranges, papayas",
];

const OPEN: [&str; 4] = [
    "Write a short poem about the sea.",
    "Explain why the sky is blue.",
    "Give three tips for learning to cook.",
    "What should I pack for a weekend of hiking?",
];

/// One workload under one configuration, summed over its prompts.
#[derive(Debug, Clone, Copy, Default)]
struct Run {
    decode_tokens: usize,
    decode_s: f64,
    drafted: u64,
    accepted: u64,
}

impl Run {
    fn tok_s(&self) -> f64 {
        self.decode_tokens as f64 / self.decode_s.max(1e-9)
    }
}

pub fn run(a: &Args) -> Result<()> {
    if a.threads == 0 || a.rounds == 0 || a.draft == 0 || a.max_tokens < 2 {
        bail!("--threads, --rounds and --draft must be positive, --max-tokens at least 2");
    }
    let path = crate::load::model_path(a.model.clone())?;
    println!("cpu: {}", crate::bench::cpu_summary());
    println!(
        "prompt-lookup benchmark: {} ({} threads, draft {}, up to {} tokens per answer, greedy, one \
         sequence at a time, {} rounds)",
        path.display(),
        a.threads,
        a.draft,
        a.max_tokens,
        a.rounds
    );
    let workloads = [("repeats its prompt", &REPEATING), ("does not", &OPEN)];
    // [workload][round] = (off, on)
    let mut runs = vec![Vec::new(); workloads.len()];
    for round in 0..a.rounds {
        for (w, (name, prompts)) in workloads.iter().enumerate() {
            let (off, answers) = measure(&path, a, 0, prompts.as_slice())?;
            let (on, with_lookup) = measure(&path, a, a.draft, prompts.as_slice())?;
            if answers != with_lookup {
                bail!("round {round}, workload {name:?}: answers with prompt lookup differ from plain decoding");
            }
            println!(
                "round {round}, {name}: {:.1} tok/s plain, {:.1} with lookup ({:.2}x), {} of {} draft tokens accepted",
                off.tok_s(),
                on.tok_s(),
                on.tok_s() / off.tok_s(),
                on.accepted,
                on.drafted
            );
            runs[w].push((off, on));
        }
    }
    println!("\n| answer | plain tok/s | with lookup tok/s | lookup / plain | drafts accepted |");
    println!("|---|---|---|---|---|");
    for ((name, _), rs) in workloads.iter().zip(&runs) {
        let off = Spread::of(rs.iter().map(|r| r.0.tok_s()));
        let on = Spread::of(rs.iter().map(|r| r.1.tok_s()));
        let ratio = Spread::of(rs.iter().map(|r| r.1.tok_s() / r.0.tok_s()));
        let (drafted, accepted) = rs.iter().fold((0, 0), |(d, a), r| (d + r.1.drafted, a + r.1.accepted));
        println!(
            "| {name} | {off:.1} | {on:.1} | {:.2}x ({:.2}-{:.2}) | {:.0}% of {drafted} |",
            ratio.median,
            ratio.min,
            ratio.max,
            100.0 * accepted as f64 / drafted.max(1) as f64
        );
    }
    Ok(())
}

/// Answers `prompts` one at a time with `prompt_lookup` draft tokens; returns the
/// decode figures and the answers.
fn measure(path: &std::path::Path, a: &Args, lookup: usize, prompts: &[&str]) -> Result<(Run, Vec<Vec<u32>>)> {
    let (model, tok) = crate::load::load(path, a.threads)?;
    let cfg = EngineConfig { kv_blocks: 128, prefix_cache: false, prompt_lookup: lookup, ..EngineConfig::default() };
    let mut e = Engine::new(model, cfg, tok.eos_ids().to_vec())?;
    let mut run = Run::default();
    let mut answers = Vec::new();
    for (i, text) in prompts.iter().enumerate() {
        let prompt = chat(&tok, text)?;
        let params = SamplingParams { max_tokens: a.max_tokens, ..SamplingParams::default() };
        e.add(Request { id: i as u64, prompt, params, salt: 0, priority: Default::default(), generated: Vec::new() })?;
        let mut answer = Vec::new();
        let mut first = None;
        let mut last = None;
        while e.has_work() {
            let events = e.step()?;
            let now = Instant::now();
            for ev in events {
                answer.push(ev.token.id);
            }
            if !answer.is_empty() {
                first.get_or_insert(now);
                last = Some(now);
            }
        }
        let (Some(first), Some(last)) = (first, last) else { bail!("prompt {i} got no token") };
        run.decode_tokens += answer.len().saturating_sub(1);
        run.decode_s += (last - first).as_secs_f64();
        answers.push(answer);
    }
    (run.drafted, run.accepted) = e.draft_tokens();
    Ok((run, answers))
}

fn chat(tok: &Tokenizer, text: &str) -> Result<Vec<u32>> {
    let rendered =
        tok.apply_chat_template(&[ChatMessage::new("user", text)], true).context("rendering the chat template")?;
    Ok(tok.encode(&rendered, true)?)
}
