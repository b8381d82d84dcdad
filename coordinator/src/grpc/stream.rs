//! The Generate stream of one call: its messages stamped with their resume
//! cursors, recorded for the key's retries, sent within the idle timeout, and
//! counted once; the run behind it ([`generate`]); a retry's replay
//! ([`replay`], [`sent_cursor`] for the shared `skip_to`); and what a resumed call needs ([`resume_of`]).

use super::*;

pub(super) fn wire_logprob(l: TokenLogprob) -> WireLogprob {
    WireLogprob {
        id: l.id,
        token: l.token,
        logprob: l.logprob,
        top: l.top.into_iter().map(|a| WireTop { id: a.id, token: a.token, logprob: a.logprob }).collect(),
    }
}

pub(super) fn chunk(text: String, token_ids: Vec<u32>, logprobs: Vec<WireLogprob>) -> GenerateResponse {
    let c = Chunk { text, token_ids, logprobs, cursor: String::new() };
    GenerateResponse { event: Some(generate_response::Event::Chunk(c)) }
}

/// The cursor a message carries (empty for none).
pub(super) fn cursor_of(event: &GenerateResponse) -> &str {
    match &event.event {
        Some(generate_response::Event::Chunk(c)) => &c.cursor,
        Some(generate_response::Event::Done(d)) => &d.cursor,
        None => "",
    }
}

pub(super) fn set_cursor(event: &mut GenerateResponse, cursor: String) {
    match &mut event.event {
        Some(generate_response::Event::Chunk(c)) => c.cursor = cursor,
        Some(generate_response::Event::Done(d)) => d.cursor = cursor,
        None => {}
    }
}

/// Metadata key of a failed stream's last cursor (its resume point).
pub const CURSOR_KEY: &str = "x-tandem-cursor";

/// The `api` label of gRPC calls.
pub(super) const API: &str = "grpc";

pub(super) type Item = Result<GenerateResponse, Status>;
pub(super) type Events = mpsc::Sender<Item>;

/// What a call with an idempotency key records for the retries that follow it.
#[derive(Clone, Debug)]
pub(super) enum Sent {
    Event(GenerateResponse),
    /// A refusal a retry would get again: its status and what it counts as.
    Refusal {
        status: Status,
        http: u16,
        code: &'static str,
    },
}

impl Sent {
    pub(super) fn refusal(e: &Error) -> Self {
        Sent::Refusal { status: status_of(e), http: crate::http::error::status(e).as_u16(), code: e.code() }
    }
}

/// A status a client that cancelled is counted under (nginx's "client closed request").
pub(super) const CLIENT_CLOSED: u16 = 499;

/// Counts a call once in `tandem_coordinator_requests_total{api="grpc"}`, when its
/// answer starts as HTTP's does: its first event, or its error, under the HTTP
/// status and code that error has over HTTP (README's table), or `499` when the
/// client went away first.
pub(super) struct Count {
    counted: bool,
}

impl Count {
    pub(super) fn new() -> Self {
        Self { counted: false }
    }

    pub(super) fn ok(&mut self) {
        self.record(200, "ok");
    }

    pub(super) fn error(&mut self, e: &Error) {
        self.record(crate::http::error::status(e).as_u16(), e.code());
    }

    /// Counted elsewhere.
    pub(super) fn defuse(mut self) {
        self.counted = true;
    }

    fn record(&mut self, status: u16, code: &'static str) {
        if !std::mem::replace(&mut self.counted, true) {
            metrics::request_finished(API, status, code);
        }
    }
}

impl Drop for Count {
    fn drop(&mut self) {
        self.record(CLIENT_CLOSED, "client_closed");
    }
}

/// What one call sends: to its client and, with an idempotency key, into the
/// key's record for the retries that follow it.
pub(super) struct Sink {
    pub(super) tx: Events,
    pub(super) recorder: Option<Recorder<Sent>>,
    pub(super) idle: Duration,
    pub(super) count: Count,
    /// The call's identity, and where a refusal with a Retry-After is remembered.
    pub(super) id: Identity,
    pub(super) pipeline: Arc<Pipeline>,
    /// The seed the answer is sampled with (a failed stream's status carries it).
    pub(super) seed: u64,
    /// Gives each message its cursor.
    pub(super) stamper: Stamper,
    /// Set for a call resumed from a cursor: messages up to it are checked, not sent,
    /// and the call's answer waits until the cursor's matched, or why not.
    pub(super) gate: Option<Gate<Status>>,
}

impl Sink {
    /// Stamps an event with its cursor (`chain` generated when it is sent),
    /// records it for the key's retries and sends it; false when the client went
    /// away or took nothing within the idle timeout. A resumed call's events up to
    /// its cursor are recorded, not sent.
    async fn send(&mut self, mut event: GenerateResponse, chain: Chain) -> bool {
        let cursor = self.stamper.stamp(chain);
        set_cursor(&mut event, cursor.to_string());
        if let Some(rec) = &self.recorder {
            rec.push(Sent::Event(event.clone()));
        }
        if let Some(g) = self.gate.as_mut() {
            match g.pass(cursor) {
                Pass::Send => {}
                Pass::Held { go_on, reached } => {
                    if reached {
                        self.count.ok();
                        metrics::stream_resume(API, "ok");
                    }
                    return go_on;
                }
                Pass::Mismatch(e) => {
                    self.refuse_resume(&e);
                    return false;
                }
            }
        }
        self.count.ok();
        send_within(&self.tx, Ok(event), self.idle, "grpc").await
    }

    /// A resumed call that cannot go on before its cursor: the call's status.
    fn refuse_resume(&mut self, e: &Error) {
        self.count.error(e);
        self.recorder = None;
        metrics::stream_resume(API, resume_outcome(&Err(e.clone())));
        let status = status_of(e);
        remember(&self.pipeline, Some(&self.id), &status);
        if let Some(g) = self.gate.as_mut() {
            g.refuse(status);
        }
    }

    /// The stream ended: a resumed one that never reached its cursor was another answer.
    fn ended(&mut self) {
        if let Some(e) = self.gate.as_ref().and_then(|g| g.ended().err()) {
            self.refuse_resume(&e);
        }
    }

    /// Ends the call with `e`, found once it was admitted: never kept for the key's
    /// retries (a refusal after admission, a deadline or a worker's failure may pass
    /// next time), so they run anew.
    ///
    /// Before a resumed call reached its cursor nothing was sent: the error is the
    /// call's status. Otherwise the status carries the last message's cursor and the
    /// seed as metadata, so the client can resume the stream anywhere.
    async fn fail(&mut self, e: &Error) {
        if self.gate.as_ref().is_some_and(Gate::waiting) {
            self.refuse_resume(e);
            return;
        }
        self.count.error(e);
        self.recorder = None;
        if *e == Error::Draining {
            metrics::stream_handoff(API);
        }
        let mut status = status_of(e);
        remember(&self.pipeline, Some(&self.id), &status);
        if let Some(Ok(v)) = self.stamper.last().map(|c| MetadataValue::try_from(c.to_string())) {
            status.metadata_mut().insert(CURSOR_KEY, v);
        }
        if let Ok(v) = MetadataValue::try_from(self.seed.to_string()) {
            status.metadata_mut().insert(crate::http::SEED_HEADER, v);
        }
        send_within(&self.tx, Err(status), self.idle, "grpc").await;
    }

    /// The answer is whole: the key's retries get it all.
    fn finish(&mut self) {
        if let Some(rec) = self.recorder.take() {
            rec.finish(true);
        }
    }
}

/// Tells the retry gate (walk step 3) how the request was refused.
pub(super) fn remember(p: &Pipeline, id: Option<&Identity>, status: &Status) {
    let md = |key: &str| status.metadata().get(key).and_then(|v| v.to_str().ok());
    p.retries.answered(id, md(RETRY_AFTER_KEY), md(ERROR_CODE_KEY));
}

/// Whether a retry with the same key should get this error again rather than run anew.
pub(super) fn keeps(e: &Error) -> bool {
    let status = crate::http::error::status(e);
    status.is_client_error() && status != axum::http::StatusCode::TOO_MANY_REQUESTS
}

/// Runs one job, streaming its events into the sink until the end, an error
/// or the client going away. The run is dropped before the last event is
/// sent, so by the time a client sees the end, the request's admission is
/// released and its workers have been told to stop.
pub(super) async fn generate(pipeline: Arc<Pipeline>, job: Job, mut sink: Sink) {
    let started = tokio::select! {
        r = pipeline.run(job) => r,
        () = sink.tx.closed() => return,
    };
    let mut run = match started {
        Ok(r) => r,
        Err(e) => {
            sink.fail(&e).await;
            return;
        }
    };
    let finish = loop {
        let event = tokio::select! {
            e = run.step() => e,
            // The client went away: returning drops the run, cancelling the workers.
            () = sink.tx.closed() => return,
        };
        match event {
            Err(e) => {
                drop(run);
                sink.fail(&e).await;
                return;
            }
            Ok(Event::Piece(p)) => {
                let logprobs = p.logprob.map(wire_logprob).into_iter().collect();
                if !sink.send(chunk(p.text, vec![p.token_id], logprobs), run.chain()).await {
                    return;
                }
                if let Some(f) = p.finish {
                    break f;
                }
            }
            Ok(Event::End(f)) => {
                let rest = run.flush();
                if !rest.is_empty() && !sink.send(chunk(rest, Vec::new(), Vec::new()), run.chain()).await {
                    return;
                }
                break f;
            }
        }
    };
    let usage = run.include_usage().then(|| {
        let u = run.usage();
        WireUsage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.total_tokens,
            cached_prompt_tokens: u.prompt_tokens_details.map_or(0, |d| d.cached_tokens),
        }
    });
    let (seed, system_fingerprint, chain) = (run.seed(), run.system_fingerprint().to_owned(), run.chain());
    drop(run);
    let finish_reason = match finish {
        Finish::Stop => FinishReason::Stop,
        Finish::Length => FinishReason::Length,
    };
    let done = Done { finish_reason: finish_reason as i32, usage, seed, system_fingerprint, cursor: String::new() };
    if sink.send(GenerateResponse { event: Some(generate_response::Event::Done(done)) }, chain).await {
        sink.finish();
    }
    sink.ended();
}

/// A recorded message's cursor; `None` for a refusal, which says the first call was
/// refused or failed (nothing to resume from).
pub(super) fn sent_cursor(s: &Sent) -> Option<&str> {
    match s {
        Sent::Event(event) => Some(cursor_of(event)),
        Sent::Refusal { .. } => None,
    }
}

/// A retry's answer: the first call's events as recorded, then live ones, ending
/// as it ended. Counted as the first call's answer was.
pub(super) async fn replay(mut replay: Replay<Sent>, tx: Events, idle: Duration) {
    let mut count = Count::new();
    loop {
        let item = match replay.next().await {
            Replayed::Item(Sent::Event(event)) => {
                count.ok();
                Ok(event)
            }
            Replayed::Item(Sent::Refusal { status, http, code }) => {
                count.record(http, code);
                Err(status)
            }
            Replayed::End => return,
            Replayed::Abandoned => {
                count.error(&Error::IdempotentOriginalFailed);
                Err(status_of(&Error::IdempotentOriginalFailed))
            }
        };
        let last = item.is_err();
        if !send_within(&tx, item, idle, "grpc").await || last {
            return;
        }
    }
}

/// The cursor a call resumes from, if any: only where the answer can be
/// regenerated exactly (its seed known: the request's, or its key's).
pub(super) fn resume_of(req: &GenerateRequest, key: Option<&str>) -> Result<Option<Cursor>, Error> {
    if req.resume_cursor.is_empty() {
        return Ok(None);
    }
    let at = req.resume_cursor.parse::<Cursor>().map_err(|why| Error::invalid("resume_cursor", why))?;
    if req.seed.is_none() && key.is_none() {
        return Err(Error::invalid(
            "resume_cursor",
            "a stream is resumed by regenerating it: send the first call's idempotency_key, or the seed it was \
             answered with (x-tandem-seed, Done.seed) as `seed`",
        ));
    }
    Ok(Some(at))
}

pub(super) fn with_seed_status(mut s: Status, seed: u64) -> Status {
    if let Ok(v) = MetadataValue::try_from(seed.to_string()) {
        s.metadata_mut().insert(crate::http::SEED_HEADER, v);
    }
    s
}
