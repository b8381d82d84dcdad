//! Goodput of an overload drill against the no-overload maximum around it (see
//! `GoodputBound`): each load's throughput, raw and at the machine's speed in it, and
//! the no-overload measurement itself.

use std::time::Duration;

use loadgen::{Arrival, Outcome, Plan, PromptSource, Report};

use super::PROMPT_TOKENS;
use crate::invariants::GoodputBound;
use crate::HarnessError;

/// Goodput under an overload against the no-overload maximum measured on the same
/// cluster just before and just after it (see `GoodputBound`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Goodput {
    /// Output tokens per second of completed requests in the no-overload
    /// measurements before and after the overload.
    pub baseline_tok_s: [f64; 2],
    /// The same under the overload.
    pub tok_s: f64,
    /// Each load's median time between two tokens of an answer, ms (before, under the
    /// overload, after; `None`: no answer had two tokens).
    pub token_ms: [Option<f64>; 3],
    /// The goodput judged: `tok_s` over the lower of `baseline_tok_s`, each at the
    /// machine's speed in its own load (see `GoodputBound`); `raw_ratio` where a load
    /// has no `token_ms`.
    pub ratio: f64,
    /// `tok_s` over the lower of `baseline_tok_s`, as measured.
    pub raw_ratio: f64,
    /// Requests the decode workers began during the overload, and those it completed
    /// (an open-loop overload only: refused requests must not be computed).
    pub computed: Option<(f64, usize)>,
    /// Requests per second the cluster completed in the first measurement (its capacity),
    /// and the Poisson rate offered during the overload.
    pub capacity_rps: f64,
    pub offered_rps: f64,
    /// The coordinator's VmRSS after the load less before it (MiB).
    pub rss_growth_mib: Option<f64>,
    /// Tokens generated again to resume streams, counted in `tok_s` (see `GoodputBound`).
    pub regenerated_tokens: u64,
}

impl Goodput {
    /// `token_ms` as `a/b/c ms per token (before/under/after)`.
    pub fn token_ms_text(&self) -> String {
        let each: Vec<String> = self.token_ms.iter().map(|t| t.map_or("-".into(), |t| format!("{t:.1}"))).collect();
        format!("{} ms per token (before/under/after)", each.join("/"))
    }
}

/// What a load got done: completed requests and their output tokens (with those
/// generated again to resume them), over the time from its first request's start to its
/// last completion.
#[derive(Debug, Clone, Copy)]
pub(super) struct Throughput {
    completed: usize,
    tokens: u64,
    secs: f64,
    /// The median time between two tokens of a completed answer, seconds.
    pub(super) token_secs: Option<f64>,
}

/// The median gap between two tokens of the completed answers in `r`: the machine's
/// speed, which a few stalls (a stream resumed elsewhere, a queue) do not move.
fn token_secs(r: &Report) -> Option<f64> {
    let done = r.records.iter().filter(|x| matches!(x.outcome, Outcome::Complete { .. }));
    let mut gaps: Vec<Duration> = done.flat_map(|x| x.itl.iter().copied()).collect();
    let mid = gaps.len() / 2;
    (!gaps.is_empty()).then(|| *gaps.select_nth_unstable(mid).1).map(|g| g.as_secs_f64())
}

impl Throughput {
    pub(super) fn of(r: &Report) -> Self {
        let first = r.records.iter().map(|x| x.start).min().unwrap_or_default();
        let done = r.records.iter().filter(|x| matches!(x.outcome, Outcome::Complete { .. }));
        let (mut completed, mut tokens, mut last) = (0, 0u64, first);
        for x in done {
            completed += 1;
            tokens += u64::from(x.output_tokens) + u64::from(x.retries.regenerated);
            last = last.max(x.start + x.e2e);
        }
        Self { completed, tokens, secs: last.saturating_sub(first).as_secs_f64().max(1e-9), token_secs: token_secs(r) }
    }

    /// What a load got done while its arrivals lasted: from its first request's start
    /// to its last one's first attempt, every output token that arrived in that window
    /// (a streamed answer's tokens by their arrival times; an answer that went on past
    /// the window counts its tokens before the end, in proportion to its content events).
    pub(super) fn during_arrivals(r: &Report) -> Self {
        let first = r.records.iter().map(|x| x.start).min().unwrap_or_default();
        let end = r.records.iter().map(|x| x.start).max().unwrap_or_default();
        let (mut completed, mut tokens) = (0, 0.0);
        for x in r.records.iter().filter(|x| matches!(x.outcome, Outcome::Complete { .. })) {
            let times = x.event_times();
            let within = times.iter().filter(|t| **t <= end).count();
            if !times.is_empty() {
                tokens += f64::from(x.output_tokens) * within as f64 / times.len() as f64;
            }
            completed += usize::from(x.start + x.e2e <= end);
        }
        Self {
            completed,
            tokens: tokens.round() as u64,
            secs: end.saturating_sub(first).as_secs_f64().max(1e-9),
            token_secs: token_secs(r),
        }
    }

    pub(super) fn tok_s(self) -> f64 {
        self.tokens as f64 / self.secs
    }

    /// Output tokens per second times the time a token took (the median gap): the
    /// share of the time an answer was streaming at the machine's pace, whatever that
    /// pace was (see `GoodputBound`).
    pub(super) fn at_speed(self) -> Option<f64> {
        self.token_secs.map(|t| self.tok_s() * t)
    }

    pub(super) fn rps(self) -> f64 {
        self.completed as f64 / self.secs
    }
}

/// The no-overload maximum (see `GoodputBound`): `bound.saturating` clients in a closed
/// loop, on prompts no other phase uses (`seed`). `requests` from the bound, or fewer to warm
/// a fresh cluster up (its first requests fault pages in and grow pools).
pub(super) async fn saturating_load(
    plan: &Plan,
    bound: &GoodputBound,
    requests: usize,
    seed: u64,
) -> Result<Throughput, HarnessError> {
    let mut b = plan.clone();
    b.requests = requests;
    b.arrival = Arrival::Closed { concurrency: bound.saturating };
    // Measured as sent: a refusal here is a failed measurement, not something to retry.
    b.retry = None;
    b.prompts = PromptSource::List(loadgen::prompts::generate(requests, PROMPT_TOKENS, seed));
    let r = loadgen::run(&b).await.map_err(|e| HarnessError::Load(format!("no-overload measurement: {e}")))?;
    let t = Throughput::of(&r);
    if t.completed < requests {
        // A refusal here means `saturating` is more than admission holds: the measurement
        // would not be a no-overload one.
        let failed: Vec<String> = r
            .records
            .iter()
            .filter(|x| !matches!(x.outcome, Outcome::Complete { .. }))
            .map(|x| x.outcome.label())
            .collect();
        return Err(HarnessError::Load(format!(
            "the no-overload measurement completed {} of {requests} requests at concurrency {}: {failed:?}",
            t.completed, bound.saturating
        )));
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use loadgen::Record;

    /// `n` answers of `tokens` tokens, one after another: each waits `gap_ms` (the slot
    /// idle, or prefill), then streams a token every `token_ms`, with one pause of
    /// `stall_ms` halfway.
    fn serial(n: usize, tokens: usize, token_ms: u64, gap_ms: u64, stall_ms: u64) -> Report {
        let each = gap_ms + token_ms * tokens as u64 + stall_ms;
        let mut itl = vec![Duration::from_millis(token_ms); tokens - 1];
        if let Some(mid) = itl.get_mut(tokens / 2) {
            *mid += Duration::from_millis(stall_ms);
        }
        let records = (0..n)
            .map(|i| Record {
                index: i,
                outcome: Outcome::Complete { finish_reason: "length".into() },
                start: Duration::from_millis(i as u64 * each),
                ttft: Some(Duration::from_millis(gap_ms + token_ms)),
                itl: itl.clone(),
                output_tokens: tokens as u32,
                usage_reported: true,
                prompt_tokens: Some(40),
                cached_tokens: None,
                e2e: Duration::from_millis(each),
                text: String::new(),
                retries: Default::default(),
                cuts: Vec::new(),
            })
            .collect();
        Report { wall: Duration::from_millis(n as u64 * each), records }
    }

    /// The same work on a machine 30% slower measures 30% less raw but the same at
    /// speed; a slot left idle between answers, or a stream stalled (a drain), costs it
    /// at any speed.
    #[test]
    fn goodput_at_speed_sees_idle_slots_and_stalls_not_a_slower_machine() {
        let fast = Throughput::of(&serial(12, 32, 10, 100, 0));
        let slow = Throughput::of(&serial(12, 32, 13, 130, 0));
        let idle = Throughput::of(&serial(12, 32, 10, 300, 0));
        let stalled = Throughput::of(&serial(12, 32, 10, 100, 200));
        assert!((slow.tok_s() / fast.tok_s() - 1.0 / 1.3).abs() < 1e-9, "raw: {} vs {}", slow.tok_s(), fast.tok_s());
        let at = |t: Throughput| t.at_speed().expect("tokens to time");
        assert!((at(slow) / at(fast) - 1.0).abs() < 1e-9, "at speed: {} vs {}", at(slow), at(fast));
        assert!(at(idle) / at(fast) < 0.85, "an idle slot: {} vs {}", at(idle), at(fast));
        assert!(at(stalled) / at(fast) < 0.85, "a stalled stream: {} vs {}", at(stalled), at(fast));
        // Without tokens to time there is no speed to judge at.
        assert_eq!(Throughput::of(&serial(3, 1, 10, 100, 0)).at_speed(), None);
    }
}
