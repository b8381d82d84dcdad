//! One request, sent and measured: HTTP/1.1 over hyper, the body read frame
//! by frame against the request's deadline, SSE events timed as they
//! arrive. Every way it can end is an [`Outcome`]; nothing here panics or
//! waits past the plan's timeout.
//!
//! Each request has its own connection (no keep-alive pool). Servers close
//! idle keep-alive connections at times of their choosing (llama-server
//! does, right after a stream), and a request written to a connection the
//! server is closing fails with "connection closed before message
//! completed" without the server having seen it: a client artifact that
//! would be counted against the server. A loopback connect costs tens of
//! microseconds, far below any latency measured here.

use std::error::Error as StdError;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::time::{timeout_at, Instant};

use crate::openai::{self, Chunk, Delta};
use crate::plan::{Api, Checked, Endpoint, Plan};
use crate::report::{Outcome, Record, Retries, EARLY_MARGIN};
use opskit::sse::SseParser;

mod grpc;

/// Largest SSE event, and largest whole or error body, we accept.
const MAX_BODY: usize = 8 << 20;

/// A resuming client's pause before its n-th resume: n times this, at most
/// [`MAX_RESUME_PAUSE`].
const RESUME_PAUSE: Duration = Duration::from_millis(50);
const MAX_RESUME_PAUSE: Duration = Duration::from_secs(1);
/// Longest note of one cut attempt in a record (its outcome, shortened).
const MAX_CUT_NOTE: usize = 240;

/// What one request sends.
pub(crate) enum Input<'a> {
    /// A prompt: raw text on completions, one user message on chat.
    Text(&'a str),
    /// A conversation so far (chat endpoint).
    Messages(&'a [Message]),
}

/// One chat message.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct Message {
    pub role: &'static str,
    pub content: String,
}

/// Sends a plan's requests; cheap to share between tasks.
#[derive(Clone)]
pub(crate) struct Sender {
    http: Client<HttpConnector, Full<Bytes>>,
    plan: Arc<Plan>,
    checked: Arc<Checked>,
    /// Names this run in a resuming client's keys: a key names one request, and two
    /// runs of one plan (a baseline, then the drill) send other bodies at one index.
    run: u64,
}

impl Sender {
    pub fn new(plan: &Plan, checked: Checked) -> Self {
        let mut conn = HttpConnector::new();
        conn.set_nodelay(true);
        let http = Client::builder(TokioExecutor::new()).pool_max_idle_per_host(0).build(conn);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let run = (nanos as u64) ^ (u64::from(std::process::id()) << 32);
        Self { http, plan: Arc::new(plan.clone()), checked: Arc::new(checked), run }
    }

    fn body(&self, index: usize, input: &Input<'_>) -> Value {
        let p = &self.plan;
        let mut b = json!({
            "model": p.model,
            "max_tokens": p.max_tokens,
            "temperature": 0,
            "stream": p.stream,
        });
        if let Some((s, seed)) = p.sampled.and_then(|s| Some((s, s.seed_of(index)?))) {
            b["temperature"] = json!(s.temperature);
            b["top_p"] = json!(s.top_p);
            b["seed"] = json!(seed);
        }
        match (input, p.endpoint) {
            (Input::Text(prompt), Endpoint::Completions) => b["prompt"] = json!(prompt),
            (Input::Text(prompt), Endpoint::Chat) => b["messages"] = json!([{"role": "user", "content": prompt}]),
            // `Plan::validate` keeps conversations to the chat endpoint.
            (Input::Messages(m), _) => b["messages"] = json!(m),
        }
        if p.stream && p.include_usage {
            b["stream_options"] = json!({"include_usage": true});
        }
        if p.ignore_eos {
            b["ignore_eos"] = json!(true);
        }
        b
    }

    /// Sends request `index` with `input` (again after a 429 or 503 refusal when the
    /// plan's clients retry); `t0` is the run's start.
    pub async fn send(&self, index: usize, input: &Input<'_>, t0: Instant) -> Record {
        if self.plan.api == Api::Grpc {
            return self.send_grpc(index, input, t0).await;
        }
        if self.plan.resume {
            return self.send_resuming(index, input, t0).await;
        }
        let Some(retry) = self.plan.retry else {
            let deadline = Instant::now() + self.plan.timeout;
            return self.attempt(index, input, t0, None, deadline).await.0;
        };
        let eager = retry.eager(index);
        // A careful client names its request, so the server knows its retries apart
        // from a new request with the same body.
        let key = (!eager).then(|| format!("loadgen-{}-{index}", self.plan.seed));
        let first = Instant::now();
        let deadline = first + self.plan.timeout;
        let mut retries = Retries::default();
        // When the last refusal's Retry-After is up.
        let mut not_before: Option<Instant> = None;
        loop {
            let sent = Instant::now();
            let early = not_before.is_some_and(|t| sent + EARLY_MARGIN < t);
            let (mut record, retry_after) = self.attempt(index, input, t0, key.as_deref(), deadline).await;
            let refused = matches!(record.outcome, Outcome::HttpError { status: 429 | 503, .. });
            if early {
                retries.early += 1;
                retries.early_served += u32::from(!refused);
            }
            let now = Instant::now();
            let wait = if eager { retry.eager_delay } else { retry_after.unwrap_or(Duration::from_secs(1)) };
            if !refused || retries.sent >= retry.max || now + wait >= deadline {
                record.start = first - t0;
                record.e2e = now - first;
                retries.last_start = (retries.sent > 0).then(|| sent - t0);
                record.retries = retries;
                return record;
            }
            // A retry refused as too soon is still held to the Retry-After it had: the one
            // it was told then counts, not this answer's (the time left, rounded up).
            let too_soon = matches!(&record.outcome, Outcome::HttpError { code: Some(c), .. } if c == "retry_too_soon");
            if !too_soon || not_before.is_none() {
                not_before = Some(now + retry_after.unwrap_or_default());
            }
            tokio::time::sleep(wait).await;
            retries.sent += 1;
        }
    }

    /// Sends request `index` as a resuming client ([`Plan::resume`]): again from its
    /// last event's cursor whenever its stream is cut or handed off.
    async fn send_resuming(&self, index: usize, input: &Input<'_>, t0: Instant) -> Record {
        let key = self.resume_key(index);
        let deadline = Instant::now() + self.plan.timeout;
        if !self.plan.stream {
            return self.send_again_whole(index, input, t0, &key, deadline).await;
        }
        let mut m = Meter::new(index, t0);
        let mut last_id: Option<String> = None;
        let (mut resumed, mut regenerated) = (0, 0);
        let mut retries = Retries::default();
        loop {
            let (outcome, retry_after) = self.stream_from(&mut m, index, input, &key, &mut last_id, deadline).await;
            if self.retried(index, &outcome, retry_after, &mut retries, deadline, t0).await {
                continue;
            }
            if !is_cut(&outcome) || resumed >= crate::MAX_RESUMES || Instant::now() >= deadline {
                let mut r = m.end(outcome);
                (r.retries.resumed, r.retries.regenerated) = (resumed, regenerated);
                (r.retries.sent, r.retries.last_start) = (retries.sent, retries.last_start);
                return r;
            }
            m.cut(&outcome);
            resumed += 1;
            regenerated += last_id.as_deref().map_or(0, cursor_tokens);
            resume_pause(resumed).await;
        }
    }

    /// A resuming client's whole (non-streamed) request: sent again with its key, whole,
    /// whenever it is cut, as [`Sender::send_resuming`] resumes a stream. One record: the
    /// last attempt's answer, timed from the first.
    async fn send_again_whole(
        &self,
        index: usize,
        input: &Input<'_>,
        t0: Instant,
        key: &str,
        deadline: Instant,
    ) -> Record {
        let first = Instant::now();
        let mut resumed = 0;
        let mut retries = Retries::default();
        let mut cuts = Meter::new(index, t0);
        cuts.start = first;
        loop {
            let (mut r, retry_after) = self.attempt(index, input, t0, Some(key), deadline).await;
            if self.retried(index, &r.outcome, retry_after, &mut retries, deadline, t0).await {
                continue;
            }
            if !is_cut(&r.outcome) || resumed >= crate::MAX_RESUMES || Instant::now() >= deadline {
                let end = r.start + r.e2e;
                r.start = first - t0;
                r.e2e = end.saturating_sub(r.start);
                (r.retries.resumed, r.retries.sent, r.retries.last_start) = (resumed, retries.sent, retries.last_start);
                r.cuts = cuts.cuts;
                return r;
            }
            cuts.cut(&r.outcome);
            resumed += 1;
            resume_pause(resumed).await;
        }
    }

    /// Whether a resuming client with [`Plan::retry`] sends a refused request again
    /// (429, or a 503 that is no hand-off): if so, it has waited out the refusal's
    /// `Retry-After` (its eager delay for an eager client) and counted the retry and
    /// when it is sent. Not when there is no retry policy, the outcome is no refusal,
    /// retries are used up, or the wait would pass the request's timeout.
    async fn retried(
        &self,
        index: usize,
        outcome: &Outcome,
        retry_after: Option<Duration>,
        retries: &mut Retries,
        deadline: Instant,
        t0: Instant,
    ) -> bool {
        let Some(retry) = self.plan.retry else { return false };
        let refused = is_refusal(outcome);
        if !refused || retries.sent >= retry.max {
            return false;
        }
        let wait = if retry.eager(index) { retry.eager_delay } else { retry_after.unwrap_or(Duration::from_secs(1)) };
        if Instant::now() + wait >= deadline {
            return false;
        }
        tokio::time::sleep(wait).await;
        retries.sent += 1;
        retries.last_start = Some(Instant::now() - t0);
        true
    }

    /// One attempt's HTTP request for request `index`: the plan's headers, `key` as its
    /// `Idempotency-Key`, and as `x-request-timeout-ms` the server-side deadline left to
    /// a request the client gives up on at `deadline` ([`Sender::deadline_left`]).
    fn request(&self, index: usize, input: &Input<'_>, key: Option<&str>, deadline: Instant) -> Request<Full<Bytes>> {
        let mut req = Request::new(Full::new(Bytes::from(self.body(index, input).to_string())));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = self.checked.uri.clone();
        *req.headers_mut() = self.checked.headers.clone();
        if let Some(v) = key.and_then(|k| hyper::header::HeaderValue::from_str(k).ok()) {
            req.headers_mut().insert("idempotency-key", v);
        }
        if let Some(left) = self.deadline_left(deadline) {
            req.headers_mut().insert("x-request-timeout-ms", hyper::header::HeaderValue::from(ms(left)));
        }
        req
    }

    /// The server-side deadline ([`Plan::deadline`]) left to an attempt of a request the
    /// client gives up on at `deadline` (the plan's timeout after its first attempt): the
    /// plan's deadline less the time since that first attempt, at least 1 ms. A retry or
    /// a resume asks for what the request has left, not for a whole deadline again, so
    /// the server ends a request that keeps being cut when its first attempt said it should.
    pub(super) fn deadline_left(&self, deadline: Instant) -> Option<Duration> {
        let whole = self.plan.deadline?;
        let spent = deadline.checked_sub(self.plan.timeout).map_or(Duration::ZERO, |first| first.elapsed());
        Some(whole.saturating_sub(spent).max(Duration::from_millis(1)))
    }

    /// The `Idempotency-Key` of a resuming client's request `index`: it names one
    /// request of one run (two runs of one plan send other bodies at one index).
    fn resume_key(&self, index: usize) -> String {
        format!("loadgen-{}-{:x}-{index}", self.plan.seed, self.run)
    }

    /// One attempt of a resuming client's stream, from the cursor in `last_id` (none:
    /// from the start), which it moves on as events arrive; also a refusal's
    /// `Retry-After`.
    async fn stream_from(
        &self,
        m: &mut Meter,
        index: usize,
        input: &Input<'_>,
        key: &str,
        last_id: &mut Option<String>,
        deadline: Instant,
    ) -> (Outcome, Option<Duration>) {
        let mut req = self.request(index, input, Some(key), deadline);
        if let Some(v) = last_id.as_deref().and_then(|id| hyper::header::HeaderValue::from_str(id).ok()) {
            req.headers_mut().insert("last-event-id", v);
        }
        let resp = match timeout_at(deadline, self.http.request(req)).await {
            Err(_) => return (Outcome::Timeout, None),
            Ok(Err(e)) => return (Outcome::Transport(chain(&e)), None),
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        let retry_after = retry_after(resp.headers());
        let mut body = resp.into_body();
        if !status.is_success() {
            let error = match read_all(&mut body, deadline).await {
                Ok(b) => openai::read_error(&b),
                Err(e) => openai::ErrorBody { code: None, message: format!("(error body unread: {e})") },
            };
            let outcome = Outcome::HttpError { status: status.as_u16(), code: error.code, message: error.message };
            return (outcome, retry_after);
        }
        (stream(m, &mut body, deadline, last_id).await, None)
    }

    /// One attempt of request `index`, ending by `deadline` at the latest (the
    /// plan's timeout from the first attempt); with an `Idempotency-Key` when `key`
    /// is given. Also the `Retry-After` of a refusal.
    async fn attempt(
        &self,
        index: usize,
        input: &Input<'_>,
        t0: Instant,
        key: Option<&str>,
        deadline: Instant,
    ) -> (Record, Option<Duration>) {
        let m = Meter::new(index, t0);
        let req = self.request(index, input, key, deadline);
        let resp = match timeout_at(deadline, self.http.request(req)).await {
            Err(_) => return (m.end(Outcome::Timeout), None),
            Ok(Err(e)) => return (m.end(Outcome::Transport(chain(&e))), None),
            Ok(Ok(r)) => r,
        };
        let status = resp.status();
        let retry_after = retry_after(resp.headers());
        let mut body = resp.into_body();
        if !status.is_success() {
            let error = match read_all(&mut body, deadline).await {
                Ok(b) => openai::read_error(&b),
                Err(e) => openai::ErrorBody { code: None, message: format!("(error body unread: {e})") },
            };
            let outcome = Outcome::HttpError { status: status.as_u16(), code: error.code, message: error.message };
            return (m.end(outcome), retry_after);
        }
        (self.answer(m, status, body, deadline).await, None)
    }

    /// The rest of an answer whose status was a success.
    async fn answer(&self, mut m: Meter, status: hyper::StatusCode, mut body: Incoming, deadline: Instant) -> Record {
        if !self.plan.stream {
            let outcome = match read_all(&mut body, deadline).await {
                Err(Read::Timeout) => Outcome::Timeout,
                Err(Read::Transport(e)) => Outcome::Transport(e),
                Err(Read::TooLarge) => Outcome::Protocol(format!("the response passed {MAX_BODY} bytes")),
                Ok(b) => match openai::read_response(&b) {
                    Err(e) => Outcome::Protocol(e),
                    Ok(Chunk::Error(e)) => {
                        Outcome::HttpError { status: status.as_u16(), code: e.code, message: e.message }
                    }
                    Ok(Chunk::Done) => Outcome::Protocol("a whole response cannot be [DONE]".into()),
                    Ok(Chunk::Data(d)) => {
                        m.whole(d);
                        m.finished()
                    }
                },
            };
            return m.end(outcome);
        }
        let outcome = stream(&mut m, &mut body, deadline, &mut None).await;
        m.end(outcome)
    }
}

/// A resuming client's pause before its `resumed`-th resume: a front sends the new
/// connection to a live coordinator; the pause keeps a client with none left from
/// spinning on refused connects.
async fn resume_pause(resumed: u32) {
    tokio::time::sleep((RESUME_PAUSE * resumed).min(MAX_RESUME_PAUSE)).await;
}

/// A response's `Retry-After` in whole seconds, when it has one.
fn retry_after(headers: &hyper::HeaderMap) -> Option<Duration> {
    headers
        .get(hyper::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}

/// The token count a resume cursor names: its leading digits (tandem's cursors are
/// `TOKENS-HASH16[.ORDINAL]`); 0 when it has none.
fn cursor_tokens(cursor: &str) -> u32 {
    let end = cursor.find(|c: char| !c.is_ascii_digit()).unwrap_or(cursor.len());
    cursor[..end].parse().unwrap_or(0)
}

/// Whether a resuming client sends `outcome`'s request again: its connection broke, or
/// it was handed off or refused by a coordinator going away. `idempotent_original_failed`:
/// the retry reached the coordinator that still ran the first attempt, which then ended
/// (its client, this one, had gone); sent again, the key is free and the answer is
/// regenerated there.
/// A refusal a retrying client sends again after its `Retry-After`: HTTP 429 or 503,
/// gRPC `RESOURCE_EXHAUSTED` or `UNAVAILABLE` with an error code, none of them a cut
/// stream to resume instead.
fn is_refusal(outcome: &Outcome) -> bool {
    let refused = match outcome {
        Outcome::HttpError { status, .. } => matches!(status, 429 | 503),
        Outcome::GrpcStatus { status, code: Some(_), .. } => {
            matches!(status.as_str(), "ResourceExhausted" | "Unavailable")
        }
        _ => false,
    };
    refused && !is_cut(outcome)
}

fn is_cut(outcome: &Outcome) -> bool {
    match outcome {
        Outcome::Transport(_) => true,
        Outcome::StreamError { code: Some(c), .. } => c == "coordinator_draining" || c == "idempotent_original_failed",
        Outcome::HttpError { status: 503, code: Some(c), .. } | Outcome::GrpcStatus { code: Some(c), .. } => {
            matches!(c.as_str(), "shutting_down" | "coordinator_draining" | "idempotent_original_failed")
        }
        _ => false,
    }
}

/// Reads SSE events to the end of the stream, keeping the last event id (its
/// resume cursor) in `last_id`.
async fn stream(m: &mut Meter, body: &mut Incoming, deadline: Instant, last_id: &mut Option<String>) -> Outcome {
    let mut parser = SseParser::new(MAX_BODY);
    let mut events = Vec::new();
    loop {
        let frame = match timeout_at(deadline, body.frame()).await {
            Err(_) => return Outcome::Timeout,
            Ok(None) => return m.finished(),
            Ok(Some(Err(e))) => return Outcome::Transport(chain(&e)),
            Ok(Some(Ok(f))) => f,
        };
        let Ok(bytes) = frame.into_data() else { continue };
        let now = Instant::now();
        if let Err(e) = parser.push(&bytes, &mut events) {
            return Outcome::Protocol(e.to_string());
        }
        for ev in events.drain(..) {
            if ev.id.is_some() {
                last_id.clone_from(&ev.id);
            }
            match openai::read_event(ev.event.as_deref(), &ev.data) {
                Err(e) => return Outcome::Protocol(e),
                Ok(Chunk::Error(e)) => return Outcome::StreamError { code: e.code, message: e.message },
                Ok(Chunk::Data(d)) => m.delta(d, now),
                Ok(Chunk::Done) => return m.finished(),
            }
        }
    }
}

/// A request's measurements so far.
struct Meter {
    index: usize,
    t0: Instant,
    start: Instant,
    ttft: Option<Duration>,
    last: Option<Instant>,
    itl: Vec<Duration>,
    content_events: u32,
    usage_tokens: Option<u32>,
    prompt_tokens: Option<u32>,
    cached_tokens: Option<u32>,
    finish_reason: Option<String>,
    text: String,
    cuts: Vec<String>,
}

impl Meter {
    fn new(index: usize, t0: Instant) -> Self {
        Self {
            index,
            t0,
            start: Instant::now(),
            ttft: None,
            last: None,
            itl: Vec::new(),
            content_events: 0,
            usage_tokens: None,
            prompt_tokens: None,
            cached_tokens: None,
            finish_reason: None,
            text: String::new(),
            cuts: Vec::new(),
        }
    }

    /// An attempt of a resuming client ended with `outcome` and is sent again: noted, with
    /// when, for the record ([`Record::cuts`]).
    fn cut(&mut self, outcome: &Outcome) {
        let mut what = format!("{outcome:?}");
        if what.len() > MAX_CUT_NOTE {
            let mut end = MAX_CUT_NOTE;
            while !what.is_char_boundary(end) {
                end -= 1;
            }
            what.truncate(end);
            what.push('…');
        }
        self.cuts.push(format!("{:.1} s: {what}", self.start.elapsed().as_secs_f64()));
    }

    /// One stream chunk, arrived at `now`.
    fn delta(&mut self, d: Delta, now: Instant) {
        self.usage(&d);
        if let Some(c) = d.content.filter(|c| !c.is_empty()) {
            match self.last {
                None => self.ttft = Some(now - self.start),
                Some(last) => self.itl.push(now - last),
            }
            self.last = Some(now);
            self.content_events += 1;
            self.text.push_str(&c);
        }
        if d.finish_reason.is_some() {
            self.finish_reason = d.finish_reason;
        }
    }

    /// A whole (non-streaming) answer.
    fn whole(&mut self, d: Delta) {
        self.usage(&d);
        self.text = d.content.unwrap_or_default();
        self.finish_reason = d.finish_reason;
    }

    fn usage(&mut self, d: &Delta) {
        self.usage_tokens = d.completion_tokens.or(self.usage_tokens);
        self.prompt_tokens = d.prompt_tokens.or(self.prompt_tokens);
        self.cached_tokens = d.cached_tokens.or(self.cached_tokens);
    }

    /// The outcome of a body that ended normally.
    fn finished(&self) -> Outcome {
        match &self.finish_reason {
            Some(r) => Outcome::Complete { finish_reason: r.clone() },
            None => Outcome::Protocol("the answer ended without a finish_reason".into()),
        }
    }

    fn end(self, outcome: Outcome) -> Record {
        let end = Instant::now();
        Record {
            index: self.index,
            outcome,
            start: self.start - self.t0,
            ttft: self.ttft,
            itl: self.itl,
            output_tokens: self.usage_tokens.unwrap_or(self.content_events),
            usage_reported: self.usage_tokens.is_some(),
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            e2e: end - self.start,
            text: self.text,
            retries: Retries::default(),
            cuts: self.cuts,
        }
    }
}

/// Why a whole body could not be read.
#[derive(Debug, thiserror::Error)]
enum Read {
    #[error("timed out")]
    Timeout,
    #[error("{0}")]
    Transport(String),
    #[error("more than {MAX_BODY} bytes")]
    TooLarge,
}

async fn read_all(body: &mut Incoming, deadline: Instant) -> Result<Vec<u8>, Read> {
    let mut out = Vec::new();
    loop {
        match timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(Read::Timeout),
            Ok(None) => return Ok(out),
            Ok(Some(Err(e))) => return Err(Read::Transport(chain(&e))),
            Ok(Some(Ok(f))) => {
                if let Ok(b) = f.into_data() {
                    if out.len() + b.len() > MAX_BODY {
                        return Err(Read::TooLarge);
                    }
                    out.extend_from_slice(&b);
                }
            }
        }
    }
}

/// An error and its sources, `a: b: c`.
fn chain(e: &(dyn StdError + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(": ");
        s.push_str(&c.to_string());
        src = c.source();
    }
    s
}

/// `d` in whole milliseconds, rounded up (a first attempt, a few microseconds after the
/// request began, still asks for its whole deadline), as a header carries it.
fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1_000)).unwrap_or(u64::MAX)
}
