//! The steady load of a chaos run: its tenants' plans with their undisturbed answers
//! ([`steady_loads`]), each judged request by request as it ends ([`run_steady`]), and
//! the bursts' requests judged at the end ([`judge_burst`]).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use loadgen::{Api, Arrival, Outcome, Plan, PromptSource, Report, Retry, Sampled};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::goodput::lead_in;
use super::{ChaosOptions, Found, BATCH_KEY, DEADLINE, GRACE, INTERACTIVE_KEY, MAX_REQUESTS, MAX_TOKENS, MODEL};
use crate::invariants::{Guarantee, Invariants, Violation};
use crate::reference::reference_texts;
use crate::HarnessError;
/// The steady load's prompts: short and long in turn.
fn prompts(n: usize, seed: u64) -> Vec<String> {
    let short = loadgen::prompts::generate(n.div_ceil(2), 40, seed);
    let long = loadgen::prompts::generate(n / 2, 300, seed + 1);
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(if i % 2 == 0 { short[i / 2].clone() } else { long[i / 2].clone() });
    }
    out
}

const SAMPLED: Sampled = Sampled { every: 2, temperature: 0.8, top_p: 0.95, seed: 4242 };

/// A burst's requests: each complete or a typed error, within its deadline and grace.
pub(super) fn judge_burst(report: &Report) -> Vec<Violation> {
    let mut v = Vec::new();
    for r in &report.records {
        match &r.outcome {
            Outcome::Complete { .. } => {}
            o if o.error_code().is_some() => {}
            other => v.push(Violation::new(
                Guarantee::G1,
                format!("burst request {}: lost, not a typed outcome: {other:?}", r.index),
            )),
        }
        if r.e2e > DEADLINE + GRACE {
            v.push(Violation::new(
                Guarantee::G4,
                format!("burst request {}: ran {:?}, past its deadline", r.index, r.e2e),
            ));
        }
    }
    v
}

/// One steady load: its plan and each request's undisturbed answer.
#[derive(Clone)]
pub(super) struct Steady {
    /// Names its requests in violations.
    pub(super) name: &'static str,
    pub(super) plan: Plan,
    pub(super) reference: Vec<String>,
}

/// Requests in a run's steady load: its rate over the lead-in and the faults' duration.
pub fn requests(o: &ChaosOptions) -> usize {
    let secs = (lead_in(o.schedule.duration) + o.schedule.duration).as_secs_f64();
    ((o.load_rps * secs).ceil() as usize).clamp(3, MAX_REQUESTS)
}

/// How often a client of the steady load sends a refused request again (after the
/// refusal's `Retry-After`, HTTP header or gRPC metadata).
const RETRIES: u32 = 4;

/// The steady loads of a run, a third each: the `interactive` tenant streams over HTTP
/// (`interactive`) and over gRPC (`interactive-grpc`), the `batch` tenant asks for whole
/// answers over HTTP. Resuming clients all, each load with its own prompts (short and
/// long), half of each sampled with a seed; they also wait out a refusal's `Retry-After`
/// (HTTP 429/503; gRPC `RESOURCE_EXHAUSTED`/`UNAVAILABLE` with `retry-after`) and send
/// again. The
/// references are the engine's, undisturbed. Their plans' `base_url` is left to fill in
/// once the cluster listens (the plan's `api` says which listener).
pub(super) async fn steady_loads(o: &ChaosOptions) -> Result<Vec<Steady>, HarnessError> {
    let total = requests(o);
    let seed = o.schedule.seed;
    let (batch, grpc) = (total / 3, total / 3);
    let mut out = Vec::new();
    for (name, key, n, api, stream, prompt_seed) in [
        ("interactive", INTERACTIVE_KEY, total - batch - grpc, Api::Http, true, seed),
        ("interactive-grpc", INTERACTIVE_KEY, grpc, Api::Grpc, true, seed.wrapping_add(4)),
        ("batch", BATCH_KEY, batch, Api::Http, false, seed.wrapping_add(2)),
    ] {
        if n == 0 {
            continue;
        }
        let prompts = prompts(n, prompt_seed);
        let p2 = prompts.clone();
        let reference = tokio::task::spawn_blocking(move || reference_texts(&p2, MAX_TOKENS, true, Some(SAMPLED)))
            .await
            .map_err(|e| HarnessError::Setup(format!("reference task: {e}")))??;
        let mut plan = Plan::new(String::new(), MODEL);
        plan.requests = n;
        plan.arrival = Arrival::Poisson { rate: o.load_rps * n as f64 / total as f64 };
        plan.prompts = PromptSource::List(prompts);
        plan.max_tokens = MAX_TOKENS;
        plan.stream = stream;
        plan.ignore_eos = true;
        plan.seed = prompt_seed;
        plan.sampled = Some(SAMPLED);
        plan.deadline = Some(DEADLINE);
        plan.timeout = DEADLINE + GRACE + Duration::from_secs(10);
        plan.api_key = Some(key.into());
        plan.resume = true;
        plan.api = api;
        plan.retry = Some(Retry { max: RETRIES, eager_every: 0, eager_delay: Duration::ZERO });
        out.push(Steady { name, plan, reference });
    }
    Ok(out)
}

/// Runs one steady load, judging each request as it ends: its outcome, its text, its
/// deadline.
pub(super) fn run_steady(
    s: Steady,
    start: Instant,
    found: Arc<Mutex<Vec<Found>>>,
) -> tokio::task::JoinHandle<Result<Report, HarnessError>> {
    tokio::spawn(async move {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<loadgen::Record>();
        let Steady { name, plan, reference } = s;
        let judge = tokio::spawn(async move {
            let inv = Invariants { deadline: DEADLINE, grace: GRACE, ..Invariants::default() };
            while let Some(r) = rx.recv().await {
                let one = Report { wall: Duration::ZERO, records: vec![r] };
                let at_ms = start.elapsed().as_millis() as u64;
                let mut f = found.lock().unwrap_or_else(|e| e.into_inner());
                for v in inv.requests(&one, &reference) {
                    f.push(Found { at_ms, guarantee: v.guarantee, detail: format!("{name} {}", v.detail) });
                }
            }
        });
        let hooks = loadgen::Hooks { cancel: CancellationToken::new(), records: Some(tx), origin: Some(start) };
        let report = loadgen::run_with(&plan, hooks).await;
        let _ = judge.await;
        report.map_err(|e| HarnessError::Load(format!("the {name} load: {e}")))
    })
}
