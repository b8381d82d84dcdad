//! What a run measured: one [`Record`] per request and the [`Summary`] over them.
//!
//! Latency statistics (TTFT, inter-token, end-to-end) are over completed
//! requests only: a refusal answers fast and would flatter them. Output
//! tokens count every token received, by completed and failed requests
//! alike, over the run's wall time.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

/// How a request ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", content = "detail", rename_all = "snake_case")]
pub enum Outcome {
    /// The server finished the answer (`finish_reason` from its last choice).
    Complete { finish_reason: String },
    /// A non-2xx status; `code` from the OpenAI error body `{"error":{"code",...}}`.
    HttpError { status: u16, code: Option<String>, message: String },
    /// An SSE event carrying an `error` (the status was 200 already).
    StreamError { code: Option<String>, message: String },
    /// A gRPC call ended with a non-OK status that names its error (`code` from the
    /// `x-tandem-error-code` metadata; `status` the gRPC code's name, `Unavailable`).
    /// A status without that metadata is no answer of the server's but a broken
    /// connection or a client-side failure: [`Outcome::Transport`].
    GrpcStatus { status: String, code: Option<String>, message: String },
    /// The server answered outside the protocol: a data line that is not
    /// JSON, an oversized event, a stream that ended without a finish reason.
    Protocol(String),
    /// Connect, write or read failed, or the connection closed mid-body.
    Transport(String),
    /// The plan's client timeout passed first.
    Timeout,
}

impl Outcome {
    pub fn is_complete(&self) -> bool {
        matches!(self, Outcome::Complete { .. })
    }

    /// The typed error code a failed request was told (HTTP error body, SSE error
    /// event or gRPC status metadata); `None` for a complete request and for
    /// failures no server named.
    pub fn error_code(&self) -> Option<&str> {
        match self {
            Outcome::HttpError { code, .. } | Outcome::StreamError { code, .. } | Outcome::GrpcStatus { code, .. } => {
                code.as_deref()
            }
            _ => None,
        }
    }

    /// A short grouping key: `complete`, `http 503 overloaded`,
    /// `stream_error deadline_exceeded`, `grpc Unavailable no_worker`, `protocol`, `transport`,
    /// `timeout`.
    pub fn label(&self) -> String {
        match self {
            Outcome::Complete { .. } => "complete".into(),
            Outcome::HttpError { status, code: Some(c), .. } => format!("http {status} {c}"),
            Outcome::HttpError { status, code: None, .. } => format!("http {status}"),
            Outcome::StreamError { code: Some(c), .. } => format!("stream_error {c}"),
            Outcome::StreamError { code: None, .. } => "stream_error".into(),
            Outcome::GrpcStatus { status, code: Some(c), .. } => format!("grpc {status} {c}"),
            Outcome::GrpcStatus { status, code: None, .. } => format!("grpc {status}"),
            Outcome::Protocol(_) => "protocol".into(),
            Outcome::Transport(_) => "transport".into(),
            Outcome::Timeout => "timeout".into(),
        }
    }
}

/// One request, measured on the client from the moment it was sent.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Record {
    /// Its index in the plan (which prompt it sent).
    pub index: usize,
    pub outcome: Outcome,
    /// When it started, from the start of the run.
    #[serde(rename = "start_ms", serialize_with = "ms")]
    pub start: Duration,
    /// Time to the first content event (streaming only).
    #[serde(rename = "ttft_ms", serialize_with = "opt_ms")]
    pub ttft: Option<Duration>,
    /// Gaps between consecutive content events (streaming only).
    #[serde(rename = "itl_ms", serialize_with = "vec_ms")]
    pub itl: Vec<Duration>,
    /// From `usage.completion_tokens` when the server sent it, else the
    /// number of content events (0 for a non-streaming answer without usage).
    pub output_tokens: u32,
    /// `output_tokens` came from `usage`.
    pub usage_reported: bool,
    /// `usage.prompt_tokens`, when sent.
    pub prompt_tokens: Option<u32>,
    /// `usage.prompt_tokens_details.cached_tokens`, when sent.
    pub cached_tokens: Option<u32>,
    /// Until the outcome was known.
    #[serde(rename = "e2e_ms", serialize_with = "ms")]
    pub e2e: Duration,
    /// The generated text received (also the part before a failure).
    pub text: String,
    /// What its retries met ([`crate::Plan::retry`]); all zero for a request sent once.
    pub retries: Retries,
    /// A resuming client's streams that were cut and resumed ([`crate::Plan::resume`]):
    /// for each, when it ended (from the request's start) and with what outcome. Empty
    /// for a request that was never resumed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub cuts: Vec<String>,
}

/// A request's retries: each one a new attempt after a 429 or 503 refusal. The
/// record's outcome, TTFT and tokens are its last attempt's; its start and
/// end-to-end time span them all.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Retries {
    /// Attempts sent after the first.
    pub sent: u32,
    /// Of those, sent well before the `Retry-After` of the refusal they retry (by
    /// more than [`EARLY_MARGIN`], so the server's clock agrees); a `retry_too_soon`
    /// answer does not move that `Retry-After`, as the server does not.
    pub early: u32,
    /// Of the early ones, those the server served: answered with anything but
    /// a 429 or 503 refusal. A server that keeps retries to their Retry-After
    /// has none.
    pub early_served: u32,
    /// When the last attempt was sent, from the start of the run (what its TTFT and
    /// inter-token gaps count from); `None` for a request sent once (its `start`). For a
    /// resuming client, when its last retry after a refusal was sent (its TTFT still
    /// counts from the first attempt; resumes do not move it).
    #[serde(rename = "last_start_ms", serialize_with = "opt_ms")]
    pub last_start: Option<Duration>,
    /// Times the stream was resumed from its last event's cursor after its
    /// connection broke or its coordinator drained ([`crate::Plan::resume`]).
    pub resumed: u32,
    /// Tokens the server generated again to resume: over the resumes, the token count of
    /// the cursor each was sent from (a coordinator that resumes a stream regenerates it
    /// from the start and sends only what the client lacks). A whole request sent again
    /// counts none: its cut attempt's tokens are unknown to the client.
    pub regenerated: u32,
}

/// How far before its `Retry-After` a retry must be sent to count as early: the
/// server measures from when it sent the refusal, the client from when it read it.
pub const EARLY_MARGIN: Duration = Duration::from_millis(250);

impl Record {
    /// When its answer's content events arrived, from the start of the run (streamed
    /// answers; empty otherwise).
    pub fn event_times(&self) -> Vec<Duration> {
        let Some(ttft) = self.ttft else { return Vec::new() };
        let mut t = self.retries.last_start.unwrap_or(self.start) + ttft;
        let mut out = vec![t];
        for gap in &self.itl {
            t += *gap;
            out.push(t);
        }
        out
    }
}

/// A finished run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Report {
    /// From the run's start to the end of its last request.
    #[serde(rename = "wall_ms", serialize_with = "ms")]
    pub wall: Duration,
    /// One per request started, in plan order.
    pub records: Vec<Record>,
}

impl Report {
    /// Several runs of one target as one: their records together (a
    /// percentile over all of them) and their walls summed, so the pooled
    /// output tokens/s is every run's tokens over every run's time.
    pub fn pooled<'a>(runs: impl IntoIterator<Item = &'a Report>) -> Report {
        let mut all = Report { wall: Duration::ZERO, records: Vec::new() };
        for r in runs {
            all.wall += r.wall;
            all.records.extend(r.records.iter().cloned());
        }
        all
    }

    /// Statistics over the records.
    pub fn summary(&self) -> Summary {
        let done: Vec<&Record> = self.records.iter().filter(|r| r.outcome.is_complete()).collect();
        let mut counts = BTreeMap::new();
        for r in &self.records {
            *counts.entry(r.outcome.label()).or_insert(0) += 1;
        }
        let output_tokens: u64 = self.records.iter().map(|r| u64::from(r.output_tokens)).sum();
        let secs = self.wall.as_secs_f64();
        let prompts: Vec<f64> = done.iter().filter_map(|r| r.prompt_tokens).map(f64::from).collect();
        // Computed = prompt - cached, over completed requests; only when every
        // one of them said both (a partial sum would undercount).
        let computed = done
            .iter()
            .map(|r| Some(u64::from(r.prompt_tokens?.saturating_sub(r.cached_tokens?))))
            .sum::<Option<u64>>()
            .filter(|_| !done.is_empty());
        Summary {
            requests: self.records.len(),
            ok: done.len(),
            errors: self.records.len() - done.len(),
            counts,
            wall: self.wall,
            output_tokens,
            output_tok_per_s: if secs > 0.0 { output_tokens as f64 / secs } else { 0.0 },
            mean_prompt_tokens: (!prompts.is_empty()).then(|| prompts.iter().sum::<f64>() / prompts.len() as f64),
            prompt_tokens: prompts.iter().sum::<f64>() as u64,
            computed_prompt_tokens: computed,
            ttft: Percentiles::of(done.iter().filter_map(|r| r.ttft)),
            itl: Percentiles::of(done.iter().flat_map(|r| r.itl.iter().copied())),
            e2e: Percentiles::of(done.iter().map(|r| r.e2e)),
        }
    }
}

/// Statistics of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub requests: usize,
    /// Completed requests.
    pub ok: usize,
    /// Every other outcome.
    pub errors: usize,
    /// Requests per [`Outcome::label`].
    pub counts: BTreeMap<String, usize>,
    #[serde(rename = "wall_ms", serialize_with = "ms")]
    pub wall: Duration,
    /// Output tokens of all requests.
    pub output_tokens: u64,
    /// `output_tokens` over the wall time.
    pub output_tok_per_s: f64,
    /// Mean `usage.prompt_tokens` of completed requests, when reported.
    pub mean_prompt_tokens: Option<f64>,
    /// Sum of `usage.prompt_tokens` of completed requests (0 when none reported).
    pub prompt_tokens: u64,
    /// Prompt tokens the server computed for the completed requests:
    /// `prompt_tokens - prompt_tokens_details.cached_tokens` summed; `None`
    /// unless every completed request reported both.
    pub computed_prompt_tokens: Option<u64>,
    pub ttft: Percentiles,
    /// All inter-token gaps of all completed requests, pooled.
    pub itl: Percentiles,
    pub e2e: Percentiles,
}

/// p50 and p99 of some durations (None without samples).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Percentiles {
    pub count: usize,
    #[serde(rename = "p50_ms", serialize_with = "opt_ms")]
    pub p50: Option<Duration>,
    #[serde(rename = "p99_ms", serialize_with = "opt_ms")]
    pub p99: Option<Duration>,
}

impl Percentiles {
    pub fn of(samples: impl IntoIterator<Item = Duration>) -> Self {
        // Nanoseconds are exact in f64 up to 104 days.
        let mut s: Vec<f64> = samples.into_iter().map(|d| d.as_nanos() as f64).collect();
        s.sort_by(f64::total_cmp);
        let at = |q| percentile(&s, q).map(|x| Duration::from_nanos(x.round() as u64));
        Self { count: s.len(), p50: at(0.5), p99: at(0.99) }
    }
}

/// The `q` quantile (0..=1) of ascending `sorted` values, interpolating
/// linearly between the two nearest ranks (numpy's default); None if empty.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    let last = sorted.len().checked_sub(1)?;
    let pos = q.clamp(0.0, 1.0) * last as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    let (a, b) = (*sorted.get(lo)?, *sorted.get(hi)?);
    Some(a + (b - a) * (pos - lo as f64))
}

pub(crate) fn ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

pub(crate) fn opt_ms<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => ms(d, s),
        None => s.serialize_none(),
    }
}

fn vec_ms<S: serde::Serializer>(v: &[Duration], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(v.iter().map(|d| d.as_secs_f64() * 1e3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[3.0], 0.99), Some(3.0));
        assert_eq!(percentile(&[1.0, 2.0], 0.5), Some(1.5));
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 1.0), Some(100.0));
        assert_eq!(percentile(&v, 0.5), Some(50.5));
        let p99 = percentile(&v, 0.99).unwrap_or(0.0);
        assert!((p99 - 99.01).abs() < 1e-9, "{p99}");
        assert_eq!(percentile(&v, 7.0), Some(100.0), "q is clamped");
    }

    fn rec(outcome: Outcome, ttft_ms: u64, itl_ms: &[u64], tokens: u32) -> Record {
        Record {
            index: 0,
            outcome,
            start: Duration::ZERO,
            ttft: Some(Duration::from_millis(ttft_ms)),
            itl: itl_ms.iter().map(|&m| Duration::from_millis(m)).collect(),
            output_tokens: tokens,
            usage_reported: true,
            prompt_tokens: Some(10),
            cached_tokens: Some(4),
            e2e: Duration::from_millis(ttft_ms + itl_ms.iter().sum::<u64>()),
            text: String::new(),
            retries: Default::default(),
            cuts: Vec::new(),
        }
    }

    #[test]
    fn summary_counts_outcomes_and_times_only_completed_requests() {
        let ok = || Outcome::Complete { finish_reason: "length".into() };
        let busy = Outcome::HttpError { status: 503, code: Some("overloaded".into()), message: String::new() };
        let report = Report {
            wall: Duration::from_secs(2),
            records: vec![
                rec(ok(), 100, &[10, 20], 3),
                rec(ok(), 300, &[30], 2),
                rec(busy.clone(), 1, &[], 0),
                rec(busy, 1, &[], 0),
                rec(Outcome::StreamError { code: None, message: String::new() }, 50, &[5], 1),
            ],
        };
        let s = report.summary();
        assert_eq!((s.requests, s.ok, s.errors, s.output_tokens), (5, 2, 3, 6));
        assert_eq!(s.output_tok_per_s, 3.0);
        assert_eq!(s.counts.get("complete"), Some(&2));
        assert_eq!(s.counts.get("http 503 overloaded"), Some(&2));
        assert_eq!(s.counts.get("stream_error"), Some(&1));
        assert_eq!(s.ttft.p50, Some(Duration::from_millis(200)));
        assert_eq!((s.itl.count, s.itl.p50), (3, Some(Duration::from_millis(20))));
        assert_eq!(s.e2e.count, 2);
        assert_eq!(s.mean_prompt_tokens, Some(10.0));
        assert_eq!((s.prompt_tokens, s.computed_prompt_tokens), (20, Some(12)), "(10 - 4) x 2 completed");
        assert_eq!(Report { wall: Duration::ZERO, records: vec![] }.summary().ttft, Percentiles::default());
    }

    #[test]
    fn pooled_runs_sum_their_walls_and_rank_all_records_together() {
        let ok = || Outcome::Complete { finish_reason: "length".into() };
        let a = Report { wall: Duration::from_secs(1), records: vec![rec(ok(), 100, &[10], 4)] };
        let b =
            Report { wall: Duration::from_secs(3), records: vec![rec(ok(), 300, &[30], 4), rec(ok(), 500, &[], 4)] };
        let s = Report::pooled([&a, &b]).summary();
        assert_eq!((s.requests, s.ok, s.wall, s.output_tokens), (3, 3, Duration::from_secs(4), 12));
        assert_eq!(s.output_tok_per_s, 3.0, "12 tokens over 1 s + 3 s, not the mean of 4 and 2.67 tok/s");
        assert_eq!(s.ttft.p50, Some(Duration::from_millis(300)), "the middle of all three");
        assert_eq!(s.itl.count, 2);
        assert_eq!(Report::pooled([]).summary().requests, 0);
    }

    #[test]
    fn computed_prompt_tokens_need_every_completed_request_to_say() {
        let ok = || Outcome::Complete { finish_reason: "stop".into() };
        let mut unsaid = rec(ok(), 10, &[], 1);
        unsaid.cached_tokens = None;
        let report = Report { wall: Duration::from_secs(1), records: vec![rec(ok(), 10, &[], 1), unsaid] };
        assert_eq!(report.summary().computed_prompt_tokens, None, "one request did not report cached tokens");
        let none = Report { wall: Duration::from_secs(1), records: vec![] };
        assert_eq!(none.summary().computed_prompt_tokens, None);
    }

    #[test]
    fn outcomes_serialize_with_a_kind() -> Result<(), serde_json::Error> {
        let v = serde_json::to_value(Outcome::HttpError { status: 503, code: None, message: "x".into() })?;
        assert_eq!(v["kind"], "http_error");
        assert_eq!(v["detail"]["status"], 503);
        assert_eq!(serde_json::to_value(Outcome::Timeout)?["kind"], "timeout");
        assert_eq!(serde_json::to_value(Outcome::Transport("r".into()))?["detail"], "r");
        Ok(())
    }
}
