//! What the decode worker's process tests share beyond opskit (the workspace's one harness:
//! process starter, fault proxy, metric pages, waits): worker processes with these tests'
//! flags, reference outputs from the in-process engine, and opskit's calls with these tests'
//! bound.
//!
//! Every wait is bounded and says what did not happen; nothing sleeps.
#![allow(dead_code, unused_imports)] // each test binary uses its own part of this module

use std::time::Duration;

use engine::batch::{Engine, EngineConfig, Request};
use engine::model::Model;
use engine::tokenizer::Tokenizer;
use engine::weights::Weights;
use opskit::process::Launch;
pub use opskit::process::{Proc as Worker, Signal};
pub use opskit::prom::Page;
pub use opskit::proxy::{Fault, Proxy};
use types::sampling::SamplingParams;

pub type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Model loading and long prefills on a 2-core machine; a hang hits this.
pub const WAIT: Duration = Duration::from_secs(120);

/// Awaits `fut` for at most [`WAIT`]; the error says `what` did not happen.
pub async fn within<T>(what: &str, fut: impl std::future::Future<Output = T>) -> opskit::Result<T> {
    opskit::within(what, WAIT, fut).await
}

/// Worker flags: `group`, 1 thread, 256 KV blocks and no coordinator-silence fence unless
/// `extra` sets them, then `extra`.
fn worker_args<'a>(group: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--version-group", group];
    // These tests call Health as they please, then go quiet for longer than a
    // coordinator would: the silence fence (on by default) would fence the
    // worker mid-test. A test of that fence passes the flag itself.
    let defaults = [("--threads", "1"), ("--kv-blocks", "256"), ("--coordinator-silence-fence-ms", "0")];
    for (flag, default) in defaults {
        if !extra.contains(&flag) {
            args.extend([flag, default]);
        }
    }
    args.extend_from_slice(extra);
    args
}

/// A prefill worker in `group` (see `worker_args`); the binary is found beside the tests
/// (`cargo build --workspace --bins` builds it, as `make test` does).
pub fn prefill_worker(group: &str, extra: &[&str]) -> opskit::Result<Worker> {
    Launch::bin("tandem-prefill-worker")
        .args(worker_args(group, extra))
        .wants(&["grpc", "metrics"])
        .wait(WAIT)
        .start_blocking()
}

fn decode(group: &str, extra: &[&str]) -> Launch {
    Launch::path(env!("CARGO_BIN_EXE_tandem-decode-worker"))
        .args(worker_args(group, extra))
        .wants(&["grpc", "metrics", "transfer"])
        .wait(WAIT)
}

/// A decode worker in `group` (see `worker_args`); `extra` must include
/// `--kv-load-failure-policy` unless a config sets it.
pub fn decode_worker(group: &str, extra: &[&str]) -> opskit::Result<Worker> {
    decode(group, extra).start_blocking()
}

/// [`decode_worker`], its info-level log in `log`.
pub fn decode_worker_logged(group: &str, extra: &[&str], log: &std::path::Path) -> opskit::Result<Worker> {
    decode(group, extra).env("RUST_LOG", "info").env("NO_COLOR", "1").log_file(log).start_blocking()
}

/// `addr`'s `/metrics`.
pub async fn scrape(addr: &str) -> opskit::Result<Page> {
    opskit::prom::scrape_within(addr, WAIT).await
}

/// Scrapes until the series `name{labels}` satisfies `ok` (the worker updates some values
/// asynchronously, e.g. on its reaper's next turn); a missing series never does, and the
/// error says so.
pub async fn wait_metric(
    addr: &str,
    name: &str,
    labels: &[(&str, &str)],
    ok: impl Fn(f64) -> bool,
) -> opskit::Result<f64> {
    let what = format!("{name}{labels:?} at {addr} reaching the expected value");
    opskit::poll(&what, WAIT, || async {
        let v = scrape(addr).await?.get(name, labels)?;
        // Not yet: the value is the wait's last error, so a timeout shows it.
        if ok(v) {
            Ok(Some(v))
        } else {
            Err(opskit::Error::Metric(format!("{name}{labels:?} is {v}")))
        }
    })
    .await
}

pub fn tokenizer() -> Result<Tokenizer, String> {
    let path = engine::paths::default_model_path();
    let (_, f) = Weights::from_gguf(&path).map_err(|e| format!("load {}: {e}", path.display()))?;
    Tokenizer::from_gguf(&f).map_err(|e| e.to_string())
}

/// A prompt of exactly `n` tokens cut from real text (repeated as needed).
pub fn prompt_of(tok: &Tokenizer, n: usize) -> Result<Vec<u32>, String> {
    let text = "The quick brown fox jumps over the lazy dog. The capital of France is Paris, and the capital \
                of Germany is Berlin. Rivers run to the sea, and the sea does not fill. ";
    let one = tok.encode(text, false).map_err(|e| e.to_string())?;
    Ok(one.iter().copied().cycle().take(n).collect())
}

pub fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams { max_tokens, ignore_eos: true, ..SamplingParams::default() }
}

/// Greedy output of each prompt from the single-process engine.
pub fn reference(prompts: &[Vec<u32>], max_tokens: u32) -> Result<Vec<Vec<u32>>, String> {
    let path = engine::paths::default_model_path();
    let (w, f) = Weights::from_gguf(&path).map_err(|e| format!("load {}: {e}", path.display()))?;
    let tok = Tokenizer::from_gguf(&f).map_err(|e| e.to_string())?;
    let model = Model::new(w, 2).map_err(|e| e.to_string())?;
    let cfg = EngineConfig { kv_blocks: 512, ..EngineConfig::default() };
    let mut e = Engine::new(model, cfg, tok.eos_ids().to_vec()).map_err(|e| e.to_string())?;
    for (i, p) in prompts.iter().enumerate() {
        e.add(Request {
            id: i as u64,
            prompt: p.clone(),
            params: greedy(max_tokens),
            salt: 0,
            priority: Default::default(),
            generated: Vec::new(),
        })
        .map_err(|e| e.to_string())?;
    }
    let mut out = vec![Vec::new(); prompts.len()];
    for _ in 0..100_000 {
        if !e.has_work() {
            return Ok(out);
        }
        for ev in e.step().map_err(|e| e.to_string())? {
            out[ev.id as usize].push(ev.token.id);
        }
    }
    Err("the reference engine did not finish".into())
}
