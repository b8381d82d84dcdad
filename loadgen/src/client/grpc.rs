//! One request over tandem's gRPC frontend ([`crate::Api::Grpc`]): a `Generate` call
//! whose messages are timed as SSE events are, and, for resuming clients, sent again
//! from its last message's cursor (`resume_cursor`) whenever it is cut; for retrying
//! clients, sent again after a refusal's `retry-after`, as over HTTP.
//!
//! Each attempt has its own connection, as each HTTP request has: behind a layer-4
//! front a new connection reaches the next live coordinator, which is where a cut
//! stream resumes.

use std::time::Duration;

use proto::frontend::v1::frontend_client::FrontendClient;
use proto::frontend::v1::generate_request::Input as Prompt;
use proto::frontend::v1::generate_response::Event;
use proto::frontend::v1::{ChatMessage, ChatMessages, FinishReason, GenerateRequest};
use tokio::time::{timeout_at, Instant};
use tonic::metadata::MetadataValue;
use tonic::transport::Endpoint as GrpcEndpoint;

use super::{chain, cursor_tokens, is_cut, resume_pause, Input, Meter, Sender};
use crate::openai::Delta;
use crate::plan::Endpoint;
use crate::report::Outcome;
use crate::report::Retries;

/// Metadata the coordinator names a failed call's error code with.
const ERROR_CODE_KEY: &str = "x-tandem-error-code";
/// Metadata of a refusal: whole seconds to wait before sending the call again.
const RETRY_AFTER_KEY: &str = "retry-after";
/// Largest message accepted from the server (as [`super::MAX_BODY`] for HTTP).
const MAX_MESSAGE: usize = 8 << 20;

impl Sender {
    /// Sends request `index` over gRPC; a resuming client sends it again from its
    /// last cursor whenever it is cut, and a retrying one ([`Plan::retry`]) after a
    /// refusal's `retry-after`.
    pub(super) async fn send_grpc(&self, index: usize, input: &Input<'_>, t0: Instant) -> super::Record {
        let key = if self.plan.resume { self.resume_key(index) } else { String::new() };
        let deadline = Instant::now() + self.plan.timeout;
        let mut m = Meter::new(index, t0);
        let mut cursor = String::new();
        let (mut resumed, mut regenerated) = (0, 0);
        let mut retries = Retries::default();
        loop {
            let (outcome, retry_after) = self.generate(&mut m, index, input, &key, &mut cursor, deadline).await;
            if self.retried(index, &outcome, retry_after, &mut retries, deadline, t0).await {
                continue;
            }
            if !self.plan.resume || !is_cut(&outcome) || resumed >= crate::MAX_RESUMES || Instant::now() >= deadline {
                let mut r = m.end(outcome);
                (r.retries.resumed, r.retries.regenerated) = (resumed, regenerated);
                (r.retries.sent, r.retries.last_start) = (retries.sent, retries.last_start);
                return r;
            }
            m.cut(&outcome);
            resumed += 1;
            regenerated += cursor_tokens(&cursor);
            resume_pause(resumed).await;
        }
    }

    /// The call's request message: from `cursor` on when it is not empty.
    fn grpc_request(&self, index: usize, input: &Input<'_>, key: &str, cursor: &str) -> GenerateRequest {
        let p = &self.plan;
        let message = |role: &str, content: &str| ChatMessage { role: role.into(), content: content.into() };
        let prompt = match (input, p.endpoint) {
            (Input::Text(t), Endpoint::Completions) => Prompt::Prompt((*t).to_owned()),
            (Input::Text(t), Endpoint::Chat) => Prompt::Messages(ChatMessages { messages: vec![message("user", t)] }),
            (Input::Messages(ms), _) => {
                Prompt::Messages(ChatMessages { messages: ms.iter().map(|m| message(m.role, &m.content)).collect() })
            }
        };
        let mut req = GenerateRequest {
            model: p.model.clone(),
            input: Some(prompt),
            max_tokens: Some(p.max_tokens),
            temperature: Some(0.0),
            ignore_eos: p.ignore_eos,
            include_usage: p.include_usage,
            priority: p.priority.clone().unwrap_or_default(),
            idempotency_key: key.to_owned(),
            resume_cursor: cursor.to_owned(),
            ..GenerateRequest::default()
        };
        if let Some((s, seed)) = p.sampled.and_then(|s| Some((s, s.seed_of(index)?))) {
            req.temperature = Some(f64::from(s.temperature));
            req.top_p = Some(f64::from(s.top_p));
            req.seed = Some(seed);
        }
        req
    }

    /// One `Generate` call on a new connection, its messages read into `m` and its
    /// last cursor kept in `cursor`; also a refusal's `retry-after`.
    async fn generate(
        &self,
        m: &mut Meter,
        index: usize,
        input: &Input<'_>,
        key: &str,
        cursor: &mut String,
        deadline: Instant,
    ) -> (Outcome, Option<Duration>) {
        let endpoint = match GrpcEndpoint::from_shared(self.plan.base_url.clone()) {
            Ok(e) => e,
            Err(e) => return (Outcome::Transport(chain(&e)), None),
        };
        let channel = match timeout_at(deadline, endpoint.connect()).await {
            Err(_) => return (Outcome::Timeout, None),
            Ok(Err(e)) => return (Outcome::Transport(chain(&e)), None),
            Ok(Ok(c)) => c,
        };
        let mut client = FrontendClient::new(channel).max_decoding_message_size(MAX_MESSAGE);
        let mut req = tonic::Request::new(self.grpc_request(index, input, key, cursor));
        // The call's own deadline, which tonic's channel enforces on this side as well.
        let mut due = None;
        if let Some(left) = self.deadline_left(deadline) {
            req.set_timeout(left);
            due = Some(Instant::now() + left);
        }
        if let Some(Ok(v)) = self.plan.api_key.as_ref().map(|k| MetadataValue::try_from(format!("Bearer {k}"))) {
            req.metadata_mut().insert("authorization", v);
        }
        let mut stream = match timeout_at(deadline, client.generate(req)).await {
            Err(_) => return (Outcome::Timeout, None),
            Ok(Err(status)) => return (call_outcome(&status, due), retry_after(&status)),
            Ok(Ok(r)) => r.into_inner(),
        };
        (self.read_stream(m, &mut stream, cursor, deadline, due).await, None)
    }

    /// Reads a call's messages into `m` to its end, keeping the last cursor.
    async fn read_stream(
        &self,
        m: &mut Meter,
        stream: &mut tonic::Streaming<proto::frontend::v1::GenerateResponse>,
        cursor: &mut String,
        deadline: Instant,
        due: Option<Instant>,
    ) -> Outcome {
        loop {
            let msg = match timeout_at(deadline, stream.message()).await {
                Err(_) => return Outcome::Timeout,
                Ok(Err(status)) => return call_outcome(&status, due),
                // Closed with OK: complete only when a Done came.
                Ok(Ok(None)) => return m.finished(),
                Ok(Ok(Some(msg))) => msg,
            };
            let now = Instant::now();
            match msg.event {
                Some(Event::Chunk(c)) => {
                    cursor.clone_from(&c.cursor);
                    m.delta(Delta { content: Some(c.text), ..Delta::default() }, now);
                }
                Some(Event::Done(d)) => {
                    cursor.clone_from(&d.cursor);
                    let finish = match FinishReason::try_from(d.finish_reason) {
                        Ok(FinishReason::Stop) => "stop",
                        Ok(FinishReason::Length) => "length",
                        _ => return Outcome::Protocol(format!("Done with finish_reason {}", d.finish_reason)),
                    };
                    let usage = d.usage.unwrap_or_default();
                    m.delta(
                        Delta {
                            finish_reason: Some(finish.into()),
                            prompt_tokens: Some(usage.prompt_tokens),
                            completion_tokens: Some(usage.completion_tokens),
                            cached_tokens: Some(usage.cached_prompt_tokens),
                            ..Delta::default()
                        },
                        now,
                    );
                }
                None => return Outcome::Protocol("a Generate message with no event".into()),
            }
        }
    }
}

/// A refusal's `retry-after` metadata.
fn retry_after(status: &tonic::Status) -> Option<Duration> {
    let v = status.metadata().get(RETRY_AFTER_KEY)?.to_str().ok()?;
    v.trim().parse::<u64>().ok().map(Duration::from_secs)
}

/// What a call's non-OK status means, the call's own deadline (`due`) known: once it
/// passed, a status the coordinator did not name is the client's channel giving up at
/// the deadline (tonic answers `CANCELLED`, "Timeout expired"), which gRPC defines as
/// `DEADLINE_EXCEEDED`: the request failed at its deadline, typed, and is not resumed
/// (the server's own answer at the same instant loses that race). Otherwise as
/// [`outcome_of`].
fn call_outcome(status: &tonic::Status, due: Option<Instant>) -> Outcome {
    let outcome = outcome_of(status);
    let expired = due.is_some_and(|d| Instant::now() >= d);
    let local = matches!(status.code(), tonic::Code::Cancelled | tonic::Code::DeadlineExceeded);
    if expired && local && outcome.error_code().is_none() {
        return Outcome::GrpcStatus {
            status: format!("{:?}", tonic::Code::DeadlineExceeded),
            code: Some(CLIENT_DEADLINE.into()),
            message: format!("the call's deadline passed on the client: {}", status.message()),
        };
    }
    outcome
}

/// The code of a call that reached its deadline on the client's side, the one the
/// coordinator names a deadline it enforced with.
const CLIENT_DEADLINE: &str = "deadline_exceeded";

/// What a call's non-OK status means: a typed failure when the coordinator named its
/// error code, else a connection that broke (or a failure on the client's side).
pub(super) fn outcome_of(status: &tonic::Status) -> Outcome {
    let code = status.metadata().get(ERROR_CODE_KEY).and_then(|v| v.to_str().ok()).map(str::to_owned);
    match code {
        Some(code) => Outcome::GrpcStatus {
            status: format!("{:?}", status.code()),
            code: Some(code),
            message: status.message().to_owned(),
        },
        None => Outcome::Transport(format!("{:?}: {}", status.code(), status.message())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_naming_its_code_is_typed_and_one_without_is_a_broken_connection() {
        let mut s = tonic::Status::unavailable("coordinator_draining: this coordinator is draining");
        s.metadata_mut().insert(ERROR_CODE_KEY, MetadataValue::from_static("coordinator_draining"));
        let typed = outcome_of(&s);
        assert_eq!(typed.error_code(), Some("coordinator_draining"));
        assert_eq!(typed.label(), "grpc Unavailable coordinator_draining");
        assert!(is_cut(&typed), "a hand-off is resumed");
        let mut refused = tonic::Status::resource_exhausted("rate_limited: over the tenant's rate");
        refused.metadata_mut().insert(ERROR_CODE_KEY, MetadataValue::from_static("rate_limited"));
        assert!(!is_cut(&outcome_of(&refused)), "a refusal is not resumed");
        let broken = outcome_of(&tonic::Status::unknown("h2 protocol error: broken pipe"));
        assert!(matches!(&broken, Outcome::Transport(m) if m.contains("broken pipe")), "{broken:?}");
        assert_eq!(broken.error_code(), None);
        assert!(is_cut(&broken));
    }

    /// The channel's own expiry at the call's deadline ends the request, typed; before
    /// the deadline the same status is a cut stream, resumed. (A resuming client once
    /// resumed a spent call every second with a 1 ms deadline until it gave up.)
    #[test]
    fn a_call_cancelled_at_its_own_deadline_is_deadline_exceeded_and_not_resumed() {
        let expired = tonic::Status::cancelled("Timeout expired");
        let past = Some(Instant::now());
        let o = call_outcome(&expired, past);
        assert_eq!(o.error_code(), Some("deadline_exceeded"), "{o:?}");
        assert_eq!(o.label(), "grpc DeadlineExceeded deadline_exceeded");
        assert!(!is_cut(&o), "a spent call is not resumed");
        let ahead = Some(Instant::now() + Duration::from_secs(60));
        assert!(is_cut(&call_outcome(&expired, ahead)), "before the deadline it is a cut stream");
        assert!(is_cut(&call_outcome(&expired, None)), "a call without a deadline has none to pass");
        let mut draining = tonic::Status::unavailable("coordinator_draining");
        draining.metadata_mut().insert(ERROR_CODE_KEY, MetadataValue::from_static("coordinator_draining"));
        let o = call_outcome(&draining, past);
        assert_eq!(o.error_code(), Some("coordinator_draining"), "the coordinator's own code is kept: {o:?}");
        let broken = call_outcome(&tonic::Status::unavailable("connection refused"), past);
        assert!(matches!(broken, Outcome::Transport(_)), "not every status after the deadline is the deadline");
    }
}
