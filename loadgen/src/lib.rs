//! A load generator for OpenAI-compatible servers (`/v1/completions`,
//! `/v1/chat/completions`), for benchmarks and failure drills.
//!
//! Describe a run with a [`Plan`] — target, endpoint, request count,
//! arrivals (closed loop at a concurrency, or Poisson at a rate from a
//! seed), prompts (a list, generated ones unique per request so prefix
//! caches do not help, or multi-turn chats on shared system prompts so they
//! do), `max_tokens`, streaming, optional deadline
//! (`x-request-timeout-ms`), priority (`x-priority`) and API key — then
//! [`run`] it. The [`Report`] holds one [`Record`] per request: its typed
//! [`Outcome`], start offset, time to first token, inter-token gaps, output
//! tokens, end-to-end time and text; [`Report::summary`] gives throughput,
//! p50/p99 latencies and counts by outcome.
//!
//! ```no_run
//! # async fn demo() -> Result<(), loadgen::PlanError> {
//! let mut plan = loadgen::Plan::new("http://127.0.0.1:8000", "SmolLM2-135M-Instruct");
//! plan.requests = 8;
//! let report = loadgen::run(&plan).await?;
//! println!("{:.1} tok/s", report.summary().output_tok_per_s);
//! # Ok(()) }
//! ```
//!
//! Owns: sending, timing and classifying requests. Must not: panic or hang
//! on anything a server sends (every request ends by the plan's client
//! timeout, bodies and events are size-capped, malformed replies are
//! [`Outcome::Protocol`]), retry unless the plan asks ([`Plan::retry`]: only
//! 429/503 refusals, each attempt counted in its [`Record`]; a drill wants to
//! see each failure), or judge results — callers decide what a run's outcomes
//! mean.
//! Plain HTTP/1.1, or tandem's gRPC frontend over plaintext HTTP/2 ([`Api::Grpc`]);
//! no TLS: it is meant for servers on the same network.

#![forbid(unsafe_code)]

pub mod arrival;
mod client;
pub mod openai;
mod plan;
pub mod prompts;
mod report;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Most times one request of a resuming client ([`Plan::resume`]) is resumed (within its
/// timeout): enough to outlast every coordinator behind a front being down for seconds.
pub const MAX_RESUMES: u32 = 32;

pub use plan::{Api, Arrival, Endpoint, Plan, PlanError, PromptSource, Retry, Sampled};
pub use report::{percentile, Outcome, Percentiles, Record, Report, Retries, Summary, EARLY_MARGIN};

use client::{Input, Message, Sender};

/// Ways to steer a run from outside, for drills.
#[derive(Debug, Clone, Default)]
pub struct Hooks {
    /// Cancelled: no request starts after it; requests in flight still end
    /// (by their timeout at the latest) and are reported.
    pub cancel: CancellationToken,
    /// Each record as its request ends, before the run is over.
    pub records: Option<mpsc::UnboundedSender<Record>>,
    /// The instant each record's `start` counts from; `None`: when the run starts.
    /// A drill that times its faults from its own clock passes that clock here, so a
    /// request's window and a fault's share one origin (the run's own start comes later,
    /// by however long its task waited to be scheduled). Poisson arrivals count from
    /// it too (one already due when the run starts goes at once), and so does the
    /// report's `wall`: pass an instant just before the run.
    pub origin: Option<Instant>,
}

/// Runs `plan` to the end.
pub async fn run(plan: &Plan) -> Result<Report, PlanError> {
    run_with(plan, Hooks::default()).await
}

/// Runs `plan`, observed and stoppable through `hooks`.
pub async fn run_with(plan: &Plan, hooks: Hooks) -> Result<Report, PlanError> {
    let checked = plan.validate()?;
    let work = Arc::new(Work::new(plan));
    let sender = Sender::new(plan, checked);
    let hooks = Arc::new(hooks);
    let t0 = hooks.origin.unwrap_or_else(Instant::now);
    let mut tasks: JoinSet<Vec<Record>> = JoinSet::new();
    let jobs = work.jobs();

    match plan.arrival {
        Arrival::Closed { concurrency } => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..concurrency.min(jobs) {
                let (sender, work, hooks, next) = (sender.clone(), work.clone(), hooks.clone(), next.clone());
                tasks.spawn(async move {
                    let mut mine = Vec::new();
                    while !hooks.cancel.is_cancelled() {
                        let job = next.fetch_add(1, Ordering::Relaxed);
                        if job >= jobs {
                            break;
                        }
                        mine.extend(work.run(job, &sender, &hooks, t0).await);
                    }
                    mine
                });
            }
        }
        Arrival::Poisson { rate } => {
            for (job, at) in arrival::poisson_offsets(jobs, rate, plan.seed).into_iter().enumerate() {
                tokio::select! {
                    _ = hooks.cancel.cancelled() => break,
                    _ = tokio::time::sleep_until(t0 + at) => {}
                }
                let (sender, work, hooks) = (sender.clone(), work.clone(), hooks.clone());
                tasks.spawn(async move { work.run(job, &sender, &hooks, t0).await });
            }
        }
    }

    let mut records = Vec::with_capacity(plan.requests);
    while let Some(done) = tasks.join_next().await {
        // A task ends with its records; it never panics by design, and a
        // panic would only lose that task's records.
        records.extend(done.unwrap_or_default());
    }
    records.sort_by_key(|r| r.index);
    let wall = records.iter().map(|r| r.start + r.e2e).max().unwrap_or_default();
    Ok(Report { wall, records })
}

/// A run's requests, in jobs the arrivals start: one request each, or one
/// conversation each (its turns in order).
enum Work {
    Prompts(Vec<String>),
    /// `users[i]` is request `i`'s new user message; conversation `c` is
    /// requests `c * turns ..` and opens with `system[c % system.len()]`.
    Chats {
        system: Vec<String>,
        users: Vec<String>,
        turns: usize,
    },
}

impl Work {
    fn new(plan: &Plan) -> Self {
        match &plan.prompts {
            PromptSource::List(l) => Work::Prompts((0..plan.requests).map(|i| l[i % l.len()].clone()).collect()),
            PromptSource::Generated { tokens } => Work::Prompts(prompts::generate(plan.requests, *tokens, plan.seed)),
            PromptSource::Chats { system_prompts, system_tokens, turns, user_tokens } => Work::Chats {
                system: prompts::generate(*system_prompts, *system_tokens, plan.seed),
                // Another stream than the system prompts', so no user message
                // starts like a system prompt.
                users: prompts::generate(plan.requests, *user_tokens, plan.seed.wrapping_add(1)),
                turns: *turns,
            },
        }
    }

    fn jobs(&self) -> usize {
        match self {
            Work::Prompts(p) => p.len(),
            Work::Chats { users, turns, .. } => users.len().div_ceil(*turns),
        }
    }

    async fn run(&self, job: usize, sender: &Sender, hooks: &Hooks, t0: Instant) -> Vec<Record> {
        match self {
            Work::Prompts(p) => vec![observe(hooks, sender.send(job, &Input::Text(&p[job]), t0).await)],
            Work::Chats { system, users, turns } => {
                let mut messages = vec![Message { role: "system", content: system[job % system.len()].clone() }];
                let mut out = Vec::new();
                for (i, user) in users.iter().enumerate().skip(job * turns).take(*turns) {
                    if hooks.cancel.is_cancelled() {
                        break;
                    }
                    messages.push(Message { role: "user", content: user.clone() });
                    let r = observe(hooks, sender.send(i, &Input::Messages(&messages), t0).await);
                    // Whatever came back, as a client would keep it: a failed
                    // turn's partial answer (or none) is the next turn's history.
                    messages.push(Message { role: "assistant", content: r.text.clone() });
                    out.push(r);
                }
                out
            }
        }
    }
}

fn observe(hooks: &Hooks, r: Record) -> Record {
    if let Some(tx) = &hooks.records {
        let _ = tx.send(r.clone());
    }
    r
}
