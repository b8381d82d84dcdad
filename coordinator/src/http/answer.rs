//! A run shaped as an OpenAI answer: one JSON body, or SSE events each with
//! its resume cursor (`id:`, [`crate::cursor`]); a stream asked for with
//! `Last-Event-ID` is regenerated and only the events after that cursor are
//! sent, once the cursor's hash has been checked. Also the answers of
//! retries that follow an earlier request with the same `Idempotency-Key`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, StatusCode};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::Stream;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::{error, now_secs, Api, App, Recorded};
use crate::cursor::{resume_outcome, skip_to, Cursor, Gate, Pass, Stamper};
use crate::error::Error;
use crate::idempotency::{Recorder, Replay, Replayed};
use crate::metrics;
use crate::pipeline::{send_within, Event as RunEvent, Job, Run, TokenLogprob};

/// The response header that carries the seed an answer was sampled with.
pub const SEED_HEADER: &str = "x-tandem-seed";

/// The `api` label of this frontend's resume and hand-off counters.
const API: &str = "http";

/// Admits and routes a prepared request (or answers its refusal) and shapes
/// its run as an OpenAI answer, streamed or whole; with `recorder` (an
/// `Idempotency-Key`) what it sends is recorded for retries. The answer's
/// `x-tandem-seed` header carries the seed it was sampled with. With
/// `resume` (a streamed request's `Last-Event-ID`), the answer's head waits
/// until the regenerated stream reached that cursor and matched it: a
/// mismatch or a failure before it is a plain error answer, never text.
pub(super) async fn respond(
    app: Arc<App>,
    api: Api,
    job: Result<Job, Error>,
    recorder: Option<Recorder<Recorded>>,
    resume: Option<Cursor>,
) -> Response {
    let refused = |e: Error, recorder: Option<Recorder<Recorded>>| {
        // A refusal is kept for retries only when a retry would get it again.
        let status = error::status(&e);
        if let Some(rec) = recorder {
            rec.push(Recorded::Json(status, error::body(&e)));
            rec.finish(keeps(status));
        }
        e.into_response()
    };
    let job = match job {
        Ok(j) => j,
        Err(e) => return refused(e, recorder),
    };
    let stream = job.spec.stream;
    let run = match app.pipeline.run(job).await {
        Ok(r) => r,
        Err(e) => {
            // A refusal after admission (no route, a deadline) is never kept: a retry may pass.
            if let Some(rec) = recorder {
                rec.finish(false);
            }
            if resume.is_some() {
                metrics::stream_resume(API, "failed");
            }
            return e.into_response();
        }
    };
    let seed = run.seed();
    let (gate, verified) = resume.map(Gate::new).unzip();
    let answer = Answer {
        api,
        created: now_secs(),
        model: app.pipeline.settings.model.clone(),
        run,
        recorder,
        idle: app.pipeline.settings.stream_idle_timeout,
        stamper: Stamper::default(),
        gate,
    };
    let mut response = if stream {
        let (tx, rx) = mpsc::channel::<Event>(16);
        tokio::spawn(answer.stream(tx));
        if let Some(verified) = verified {
            let checked = verified
                .await
                .unwrap_or_else(|_| Err(Error::WorkerStream("the regenerated stream ended before its cursor".into())));
            metrics::stream_resume(API, resume_outcome(&checked));
            if let Err(e) = checked {
                let mut r = e.into_response();
                insert_seed(&mut r, seed);
                return r;
            }
        }
        let events = tokio_stream::wrappers::ReceiverStream::new(rx);
        Sse::new(infallible(events)).into_response()
    } else {
        let (result, recorder) = answer.collect().await;
        let (status, body) = match &result {
            Ok(body) => (StatusCode::OK, body.clone()),
            Err(e) => (error::status(e), error::body(e)),
        };
        if let Some(rec) = recorder {
            rec.push(Recorded::Json(status, body.clone()));
            rec.finish(keeps(status));
        }
        match result {
            Ok(body) => Json(body).into_response(),
            Err(e) => e.into_response(),
        }
    };
    insert_seed(&mut response, seed);
    response
}

fn insert_seed(r: &mut Response, seed: u64) {
    if let Ok(v) = header::HeaderValue::from_str(&seed.to_string()) {
        r.headers_mut().insert(SEED_HEADER, v);
    }
}

/// Whether a retry should get this status again rather than run anew.
fn keeps(status: StatusCode) -> bool {
    status.is_success() || (status.is_client_error() && status != StatusCode::TOO_MANY_REQUESTS)
}

/// The answer of a request that follows an earlier one with its key; with
/// `resume`, only the recorded and live events after that cursor.
pub(super) async fn replay_answer(
    mut replay: Replay<Recorded>,
    stream: bool,
    idle: Duration,
    resume: Option<Cursor>,
) -> Response {
    metrics::idempotent_replay(if replay.leader_finished() { "done" } else { "inflight" });
    // The first thing the original sent: a whole answer (a JSON body, or a streamed
    // request's refusal, which went out as JSON with its status) is replayed as it was.
    let first = replay.next().await;
    let mut first = match first {
        Replayed::Item(Recorded::Json(status, body)) => return (status, Json(body)).into_response(),
        other if !stream => {
            drop(other);
            return Error::IdempotentOriginalFailed.into_response();
        }
        other => Some(other),
    };
    if let Some(at) = resume {
        let checked = skip_to(&mut replay, first.take(), at, recorded_cursor).await;
        metrics::stream_resume(API, resume_outcome(&checked));
        if let Err(e) = checked {
            return e.into_response();
        }
    }
    let (tx, rx) = mpsc::channel::<Event>(16);
    tokio::spawn(async move {
        loop {
            let next = match first.take() {
                Some(f) => f,
                None => replay.next().await,
            };
            let event = match next {
                Replayed::Item(Recorded::Event { id, data }) => Event::default().id(id).data(data),
                Replayed::Item(Recorded::Json(_, body)) => Event::default().data(body.to_string()),
                Replayed::End => return,
                Replayed::Abandoned => Event::default().data(error::body(&Error::IdempotentOriginalFailed).to_string()),
            };
            if !send_within(&tx, event, idle, "http").await {
                return;
            }
        }
    });
    Sse::new(infallible(tokio_stream::wrappers::ReceiverStream::new(rx))).into_response()
}

/// A recorded event's cursor; `None` for a JSON body, which says the original failed
/// after its head (nothing to resume from).
fn recorded_cursor(r: &Recorded) -> Option<&str> {
    match r {
        Recorded::Event { id, .. } => Some(id),
        Recorded::Json(..) => None,
    }
}

fn infallible(s: impl Stream<Item = Event>) -> impl Stream<Item = Result<Event, Infallible>> {
    use futures_util::StreamExt;
    s.map(Ok)
}

/// One token's `logprobs.content[]` entry.
fn logprob_json(l: TokenLogprob) -> Value {
    let top: Vec<Value> = l.top.into_iter().map(|a| json!({"token": a.token, "logprob": a.logprob})).collect();
    json!({"token": l.token, "logprob": l.logprob, "top_logprobs": top})
}

/// A run shaped as an OpenAI answer of one endpoint.
struct Answer {
    api: Api,
    created: u64,
    model: String,
    run: Run,
    /// Set for a request with an `Idempotency-Key`: what is sent is recorded.
    recorder: Option<Recorder<Recorded>>,
    /// How long the client may leave an event untaken before the stream ends.
    idle: Duration,
    /// Gives each event its cursor.
    stamper: Stamper,
    /// Set for a stream resumed from a cursor: events up to it are checked, not
    /// sent, and the answer's head waits until the cursor's matched, or why not.
    gate: Option<Gate<Error>>,
}

impl Answer {
    /// Runs to the end and builds the non-streaming body; hands the
    /// recorder back for the caller to record the final answer.
    async fn collect(mut self) -> (Result<Value, Error>, Option<Recorder<Recorded>>) {
        let recorder = self.recorder.take();
        (self.body().await, recorder)
    }

    async fn body(&mut self) -> Result<Value, Error> {
        let c = self.run.collect().await?;
        let usage = self.run.usage();
        let lp = self
            .run
            .logprobs()
            .then(|| json!({"content": c.logprobs.into_iter().map(logprob_json).collect::<Vec<_>>()}));
        let (text, finish, id) = (c.text, c.finish.as_str(), self.run.id());
        Ok(match self.api {
            Api::Chat => json!({
                "id": format!("chatcmpl-{id}"),
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": lp,
                    "finish_reason": finish,
                }],
                "usage": usage,
                "system_fingerprint": self.run.system_fingerprint(),
            }),
            Api::Completions => json!({
                "id": format!("cmpl-{id}"),
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
                "usage": usage,
                "system_fingerprint": self.run.system_fingerprint(),
            }),
        })
    }

    fn chunk(&self, text: Option<&str>, logprob: Option<Value>, finish: Option<&str>, first: bool) -> Value {
        let id = self.run.id();
        match self.api {
            Api::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({
                    "id": format!("chatcmpl-{id}"),
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "system_fingerprint": self.run.system_fingerprint(),
                    "choices": [{
                        "index": 0,
                        "delta": delta,
                        "logprobs": logprob.map(|l| json!({"content": [l]})),
                        "finish_reason": finish,
                    }],
                })
            }
            Api::Completions => json!({
                "id": format!("cmpl-{id}"),
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": self.run.system_fingerprint(),
                "choices": [{
                    "index": 0,
                    "text": text.unwrap_or(""),
                    "logprobs": logprob.map(|l| json!({"content": [l]})),
                    "finish_reason": finish,
                }],
            }),
        }
    }

    /// Streams SSE events until the end; a send failure means the client
    /// went away, and returning drops the run (cancelling it).
    async fn stream(mut self, tx: mpsc::Sender<Event>) {
        #[cfg(feature = "fault-injection")]
        let endless = crate::plant::endless_now();
        let mut first = true;
        if self.api == Api::Chat {
            let role = self.chunk(None, None, None, true).to_string();
            if !self.emit(&tx, role).await {
                return;
            }
            first = false;
        }
        let finish = loop {
            match self.run.step().await {
                Err(e) => {
                    // Not kept for idempotent retries (dropping the recorder abandons
                    // it): a retry runs anew.
                    self.recorder = None;
                    self.fail(&tx, e).await;
                    return;
                }
                Ok(RunEvent::Piece(p)) => {
                    let logprob = p.logprob.map(logprob_json);
                    if !p.text.is_empty() || logprob.is_some() {
                        let chunk = self.chunk(Some(&p.text), logprob, None, first).to_string();
                        if !self.emit(&tx, chunk).await {
                            return;
                        }
                    }
                    first = false;
                    if let Some(f) = p.finish {
                        break f;
                    }
                }
                Ok(RunEvent::End(f)) => {
                    let rest = self.run.flush();
                    if !rest.is_empty() {
                        let chunk = self.chunk(Some(&rest), None, None, first).to_string();
                        if !self.emit(&tx, chunk).await {
                            return;
                        }
                    }
                    break f;
                }
            }
        };
        #[cfg(feature = "fault-injection")]
        if endless {
            tracing::warn!("FAULT INJECTION: this stream never ends (planted bug; drills only)");
            tx.closed().await;
            return;
        }
        let text = if self.api == Api::Chat { None } else { Some("") };
        let end = self.chunk(text, None, Some(finish.as_str()), false).to_string();
        if !self.emit(&tx, end).await {
            return;
        }
        if self.run.include_usage() {
            let mut u = self.chunk(text, None, None, false);
            u["choices"] = json!([]);
            u["usage"] = json!(self.run.usage());
            if !self.emit(&tx, u.to_string()).await {
                return;
            }
        }
        if self.emit(&tx, "[DONE]".to_owned()).await {
            if let Some(rec) = self.recorder.take() {
                rec.finish(true);
            }
        }
        // A resumed stream that ended before its cursor was another answer.
        if let Some(g) = self.gate.as_mut() {
            if let Err(e) = g.ended() {
                g.refuse(e);
            }
        }
    }

    /// Ends the stream with `e`. Before a resumed stream reached its cursor
    /// nothing was sent: the answer becomes that error. Otherwise the headers
    /// are gone and the error travels as the last event, with no `id:` (the
    /// client's last cursor stays its last event's) but with that cursor and
    /// the seed in its body, so a client can resume the stream anywhere.
    async fn fail(&mut self, tx: &mpsc::Sender<Event>, e: Error) {
        if let Some(g) = self.gate.as_mut().filter(|g| g.waiting()) {
            g.refuse(e);
            return;
        }
        if e == Error::Draining {
            metrics::stream_handoff(API);
        }
        let mut body = error::body(&e);
        body["error"]["cursor"] = json!(self.stamper.last().map(|c| c.to_string()));
        body["error"]["seed"] = json!(self.run.seed());
        send_within(tx, Event::default().data(body.to_string()), self.idle, "http").await;
    }

    /// Stamps, records (for idempotent retries) and sends one SSE event; false
    /// when the client went away or took no event within the idle timeout. A
    /// resumed stream's events up to its cursor are recorded, not sent.
    async fn emit(&mut self, tx: &mpsc::Sender<Event>, data: String) -> bool {
        let cursor = self.stamper.stamp(self.run.chain());
        let id = cursor.to_string();
        if let Some(rec) = &self.recorder {
            rec.push(Recorded::Event { id: id.clone(), data: data.clone() });
        }
        if let Some(g) = self.gate.as_mut() {
            match g.pass(cursor) {
                Pass::Send => {}
                Pass::Held { go_on, .. } => return go_on,
                Pass::Mismatch(e) => {
                    g.refuse(e);
                    return false;
                }
            }
        }
        send_within(tx, Event::default().id(id).data(data), self.idle, "http").await
    }
}
