//! One running generation: the decode worker's token stream turned into text
//! pieces (detokenized, stop strings applied), finish reasons, usage and
//! logprobs; and request migration, which keeps that stream going when its
//! decode worker dies, is fenced or freezes.

use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

use super::{Job, Pipeline};
use crate::admission::Seat;
use crate::cluster::{next, Dispatch, Inflight, Pin, Step, WorkerStream};
use crate::cursor::Chain;
use crate::error::Error;
use crate::metrics;
use crate::openai::Usage;
use crate::tenants::Pass;
use engine::sampler::{FinishReason as EngineFinish, StopChecker};
use engine::tokenizer::IncrementalDecoder as Detokenizer;
use proto::worker::v1::{FinishReason as WireFinish, Finished, TokenChunk};

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End of sequence or a stop string.
    Stop,
    /// `max_tokens` or the context.
    Length,
}

impl Finish {
    /// The OpenAI `finish_reason`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

impl From<EngineFinish> for Finish {
    fn from(f: EngineFinish) -> Self {
        match f {
            EngineFinish::Stop => Self::Stop,
            EngineFinish::Length => Self::Length,
        }
    }
}

/// A generated token's log-probability and its alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    /// The token's vocabulary piece.
    pub token: String,
    /// Set whenever the worker reported it (always, when logprobs were asked for).
    pub logprob: Option<f32>,
    /// Most likely first.
    pub top: Vec<TopLogprob>,
}

/// One alternative token.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    pub id: u32,
    /// The token's vocabulary piece.
    pub token: String,
    pub logprob: f32,
}

/// What one generated token turned into.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    /// The token's id.
    pub token_id: u32,
    /// Text it completes, stop strings removed; may be empty (held back).
    pub text: String,
    /// Set when the request asked for logprobs.
    pub logprob: Option<TokenLogprob>,
    /// Set when this token ended the generation (a stop string): the caller
    /// stops reading, and dropping the run cancels the worker.
    pub finish: Option<Finish>,
}

/// One step of a [`Run`].
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A generated token.
    Piece(Piece),
    /// The worker ended normally; [`Run::flush`] has the text held back.
    End(Finish),
}

/// A whole generation, for non-streaming answers.
#[derive(Debug, Clone, PartialEq)]
pub struct Collected {
    pub text: String,
    /// One per token when logprobs were asked for.
    pub logprobs: Vec<TokenLogprob>,
    pub finish: Finish,
}

/// How long an ended answer waits for the worker's own end (one message, sent
/// right after the last token).
const WORKER_END_WAIT: Duration = Duration::from_millis(500);

/// Why a request moved to another decode worker (the `reason` label of
/// `tandem_coordinator_migrations_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MoveReason {
    /// The stream broke: the worker process is gone or its connection failed.
    WorkerLost,
    /// The worker ended the request as retryable: it was fenced, or drained
    /// past its grace.
    Refused,
    /// No event for `--migration-stall-ms` while the worker's load reports
    /// went stale too: a frozen process or a cut-off host.
    Stalled,
    /// The worker sent a token past the next one expected: tokens were lost.
    Gap,
}

impl MoveReason {
    #[cfg(test)]
    pub(crate) const ALL: [MoveReason; 4] =
        [MoveReason::WorkerLost, MoveReason::Refused, MoveReason::Stalled, MoveReason::Gap];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            MoveReason::WorkerLost => "worker_lost",
            MoveReason::Refused => "refused",
            MoveReason::Stalled => "stalled",
            MoveReason::Gap => "gap",
        }
    }

    /// Whether `e`, ending a decode stream, is one a request survives by moving:
    /// the worker is gone or its link broke, or it handed the request back
    /// (fenced, drained). A failed KV load is not: it comes before the first
    /// token, under the decode worker's `kv_load_failure_policy`, whose `fail`
    /// is an answer by contract.
    fn of(e: &Error) -> Option<Self> {
        use proto::worker::v1::ErrorKind as K;
        match e {
            Error::WorkerStream(_) => Some(Self::WorkerLost),
            Error::Worker { kind: K::Retryable, .. } => Some(Self::Refused),
            _ => None,
        }
    }
}

/// One running generation: the worker stream, detokenized, with stop strings;
/// moved to another decode worker when its worker is lost (request migration,
/// docs/ARCHITECTURE.md). The client sees one stream: the tokens it was sent
/// are the continuation's `generated_ids`, the continuation draws token n as
/// the first worker would have (sampling by position), and tokens are counted
/// by index, so none is sent twice or skipped.
pub struct Run {
    id: String,
    pipeline: Arc<Pipeline>,
    stream: WorkerStream,
    /// What the decode worker was given: the prompt, the request's sampling
    /// (its whole `max_tokens`), tags and deadline; a migration re-sends it
    /// with the tokens emitted so far.
    dispatch: Dispatch,
    /// Every token id the workers sent, in order (stop-string tokens included):
    /// a continuation's `generated_ids`.
    emitted: Vec<u32>,
    /// The hash of `emitted`, for stream cursors ([`crate::cursor`]).
    chain: Chain,
    /// Decode workers this request lost; a continuation avoids them.
    lost: Vec<String>,
    migrations: u32,
    /// The planted lost token on a move (`plant`): the next token is dropped.
    #[cfg(feature = "fault-injection")]
    drop_next: bool,
    /// The last event from the current worker (or when it was started): the
    /// stall bound counts from here.
    last_event: Instant,
    detok: Detokenizer,
    stop: Option<StopChecker>,
    deadline: Instant,
    prompt_tokens: u32,
    completion_tokens: u32,
    /// From the worker's `Finished`, once it arrived.
    cached_prompt_tokens: Option<u32>,
    logprobs: bool,
    include_usage: bool,
    arrived: Instant,
    last_token: Option<Instant>,
    // Released last, with the run.
    _inflight: Inflight,
    _seat: Seat,
    pass: Pass,
}

impl Drop for Run {
    fn drop(&mut self) {
        metrics::e2e(self.arrived.elapsed());
        self.pass.generated(self.completion_tokens);
    }
}

impl Run {
    pub(super) fn new(
        pipeline: Arc<Pipeline>,
        job: Job,
        id: String,
        dispatch: Dispatch,
        stream: WorkerStream,
        inflight: Inflight,
        seat: Seat,
    ) -> Self {
        let stop = StopChecker::new(&job.spec.params, pipeline.tokenizer.eos_ids()).ok();
        Self {
            id,
            pipeline,
            stream,
            dispatch,
            emitted: Vec::new(),
            chain: Chain::default(),
            lost: Vec::new(),
            migrations: 0,
            #[cfg(feature = "fault-injection")]
            drop_next: false,
            last_event: Instant::now(),
            detok: Detokenizer::new(),
            stop,
            deadline: job.deadline,
            prompt_tokens: job.ids.len() as u32,
            completion_tokens: 0,
            cached_prompt_tokens: None,
            logprobs: job.spec.params.logprobs.is_some(),
            include_usage: job.spec.include_usage,
            arrived: job.arrived,
            last_token: None,
            _inflight: inflight,
            _seat: seat,
            pass: job.pass,
        }
    }

    /// The cluster-wide request id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The seed the answer is sampled with (the request's, or the one assigned at admission).
    pub fn seed(&self) -> u64 {
        self.dispatch.params.seed.unwrap_or_default()
    }

    /// The determinism fingerprint of the workers producing the answer (hex;
    /// OpenAI's `system_fingerprint`), empty when unknown.
    pub fn system_fingerprint(&self) -> &str {
        &self.stream.placement().determinism
    }

    /// The tokens generated so far and their hash: where a stream event sent now stands.
    pub fn chain(&self) -> Chain {
        self.chain
    }

    /// The request asked for logprobs.
    pub fn logprobs(&self) -> bool {
        self.logprobs
    }

    /// The request asked for usage in a streamed answer.
    pub fn include_usage(&self) -> bool {
        self.include_usage
    }

    /// Token counts so far.
    pub fn usage(&self) -> Usage {
        Usage::new(self.prompt_tokens, self.completion_tokens, self.cached_prompt_tokens)
    }

    fn piece_of(&mut self, t: &TokenChunk) -> Piece {
        self.completion_tokens += 1;
        let now = Instant::now();
        match self.last_token {
            None => metrics::ttft(now.duration_since(self.arrived)),
            Some(prev) => metrics::tpot(now.duration_since(prev)),
        }
        self.last_token = Some(now);
        let tok = &self.pipeline.tokenizer;
        let raw = self.detok.push(tok, t.id).unwrap_or_default();
        let (text, finish) = match self.stop.as_mut() {
            Some(s) => {
                let d = s.on_token(t.id, &raw);
                (d.emit, d.finished.map(Finish::from))
            }
            None => (raw, None),
        };
        let logprob = self.logprobs.then(|| TokenLogprob {
            id: t.id,
            token: tok.token_piece(t.id).unwrap_or_default().to_owned(),
            logprob: t.logprob,
            top: t
                .top
                .iter()
                .map(|a| TopLogprob {
                    id: a.id,
                    token: tok.token_piece(a.id).unwrap_or_default().to_owned(),
                    logprob: a.logprob,
                })
                .collect(),
        });
        Piece { token_id: t.id, text, logprob, finish }
    }

    /// The next piece, or the end; a worker error or the deadline is an error.
    /// A stream that breaks, is refused or stalls moves to another decode worker
    /// (within `--migration-limit` and the deadline) and goes on from there.
    /// Once the coordinator hands its streams to a peer, [`Error::Draining`].
    pub async fn step(&mut self) -> Result<Event, Error> {
        loop {
            let stall = self.pipeline.settings.migration.stall;
            let wake = (self.last_event + stall).min(self.deadline);
            let event = tokio::select! {
                biased;
                // The coordinator is draining and a peer will resume the stream.
                () = self.pipeline.handed_off() => return Err(Error::Draining),
                e = tokio::time::timeout_at(wake, next(&mut self.stream, &self.pipeline.cluster, &self.pipeline.admission)) => e,
            };
            let event = match event {
                Err(_) if Instant::now() >= self.deadline => return Err(Error::Deadline),
                Err(_) => {
                    // Silent for the stall bound. A live worker in a long step keeps its
                    // stream (it still answers Health); one whose load reports went stale
                    // too is frozen or cut off: move.
                    let addr = self.stream.placement().decode_addr.clone();
                    if self.pipeline.cluster.load_stale(&addr) {
                        let cause = Error::WorkerStream(format!("decode worker {addr} stalled"));
                        self.migrate(MoveReason::Stalled, cause).await?;
                    } else {
                        self.last_event = Instant::now();
                    }
                    continue;
                }
                Ok(e) => e,
            };
            match event {
                Ok(Step::Token(t)) => {
                    let expected = self.emitted.len();
                    match t.index.map(|i| i as usize) {
                        // Already sent to the client (a worker re-sending after a move).
                        Some(i) if i < expected => continue,
                        Some(i) if i > expected => {
                            let cause = Error::WorkerStream(format!("token {i} arrived, {expected} was expected"));
                            self.migrate(MoveReason::Gap, cause).await?;
                            continue;
                        }
                        _ => {}
                    }
                    self.last_event = Instant::now();
                    self.emitted.push(t.id);
                    self.chain.push(t.id);
                    #[cfg(feature = "fault-injection")]
                    if std::mem::take(&mut self.drop_next) {
                        continue;
                    }
                    let piece = self.piece_of(&t);
                    if piece.finish.is_some() {
                        self.await_worker_end().await;
                    }
                    return Ok(Event::Piece(piece));
                }
                Ok(Step::Finished(f)) => {
                    self.worker_ended(&f);
                    return Ok(Event::End(match f.reason() {
                        WireFinish::Length => Finish::Length,
                        _ => Finish::Stop,
                    }));
                }
                Err(e) => match MoveReason::of(&e) {
                    Some(reason) => self.migrate(reason, e).await?,
                    None => return Err(e),
                },
            }
        }
    }

    /// Moves the request to another decode worker of the same version group and
    /// determinism fingerprint: the prompt and every token sent so far are
    /// prefilled there and it generates on from the next one. `cause` is the
    /// error the client gets when it cannot move (the limit, no peer, the
    /// deadline). Keeps the request's admission seat and tenant charge.
    async fn migrate(&mut self, reason: MoveReason, cause: Error) -> Result<(), Error> {
        let settings = self.pipeline.settings.migration;
        let from = self.stream.placement().clone();
        if self.migrations >= settings.limit {
            if settings.limit > 0 {
                metrics::migration(reason.as_str(), "limit");
                tracing::warn!(request = %self.id, reason = reason.as_str(), moves = self.migrations, "request not moved again: --migration-limit reached");
            }
            return Err(cause);
        }
        self.migrations += 1;
        self.lost.push(from.decode_addr.clone());
        tracing::warn!(
            request = %self.id, reason = reason.as_str(), from = %from.decode_addr, tokens = self.emitted.len(),
            error = %cause, "moving the request to another decode worker"
        );
        if reason == MoveReason::Stalled {
            // Frozen, not gone: when it thaws it must drop the request.
            self.pipeline.cluster.abort_later(&from.decode_addr, self.stream.request_id(), self.deadline);
        }
        // Bounded re-prefills at once: a host dying with many streams does not start a storm.
        let permit = tokio::time::timeout_at(self.deadline, self.pipeline.migrations.clone().acquire_owned()).await;
        let Ok(Ok(_permit)) = permit else {
            metrics::migration(reason.as_str(), "deadline");
            return Err(Error::Deadline);
        };
        let remaining = self.dispatch.params.max_tokens.saturating_sub(self.emitted.len() as u32).max(1);
        let mut d = self.dispatch.clone();
        d.request_id = format!("{}.m{}", self.id, self.migrations);
        d.generated = self.emitted.clone();
        d.params.max_tokens = remaining;
        d.pin = Some(Pin {
            exclude: self.lost.clone(),
            version_group: from.version_group.clone(),
            determinism: from.determinism.clone(),
        });
        let recompute = (d.prompt.len() + d.generated.len()) as u64;
        match tokio::time::timeout_at(self.deadline, self.pipeline.cluster.generate(d)).await {
            Err(_) => {
                metrics::migration(reason.as_str(), "deadline");
                Err(Error::Deadline)
            }
            Ok(Err(e)) => {
                metrics::migration(reason.as_str(), "failed");
                tracing::warn!(request = %self.id, reason = reason.as_str(), error = %e, "the request could not move");
                Err(Error::MigrationFailed { moves: self.migrations, cause: cause.to_string(), last: e.to_string() })
            }
            Ok(Ok((stream, inflight))) => {
                metrics::migration(reason.as_str(), "ok");
                metrics::migration_recomputed_tokens(recompute.saturating_sub(inflight.cached_tokens as u64));
                tracing::info!(
                    request = %self.id, to = %stream.placement().decode_addr, tokens = self.emitted.len(),
                    "the request continues on another decode worker"
                );
                self.stream = stream;
                self._inflight = inflight;
                self.last_event = Instant::now();
                #[cfg(feature = "fault-injection")]
                {
                    self.drop_next = crate::plant::move_drops_token();
                }
                Ok(())
            }
        }
    }

    /// This side's stop checker ended the answer. Where the worker ended it
    /// too (max_tokens, a stop token, EOS) its `Finished` follows at once:
    /// read it, so the worker records a completion rather than a hang-up
    /// (it counted these as `cancelled`). A stop string only this side sees:
    /// the worker's next event is another token, and dropping the run then
    /// cancels it. Bounded by [`WORKER_END_WAIT`] and the deadline.
    async fn await_worker_end(&mut self) {
        let until = (Instant::now() + WORKER_END_WAIT).min(self.deadline);
        let end =
            tokio::time::timeout_at(until, next(&mut self.stream, &self.pipeline.cluster, &self.pipeline.admission))
                .await;
        if let Ok(Ok(Step::Finished(f))) = end {
            self.worker_ended(&f);
        }
    }

    /// The worker's own end of the answer arrived: what its prefix cache saved.
    fn worker_ended(&mut self, f: &Finished) {
        // A continuation's worker counts the moved tokens as prompt: never more than the prompt.
        let cached = f.cached_prompt_tokens.min(self.prompt_tokens);
        if self.cached_prompt_tokens.is_none() {
            let tenant = self.pass.tenant();
            metrics::prefix_hit_tokens(tenant.cache_scope.label(&tenant.name), cached);
        }
        self.cached_prompt_tokens = Some(cached);
    }

    /// Text held back by the detokenizer and stop checker, once the worker
    /// ended normally ([`Event::End`]).
    pub fn flush(&mut self) -> String {
        let mut rest = self.detok.finish(&self.pipeline.tokenizer).unwrap_or_default();
        if let Some(s) = self.stop.as_mut() {
            let d = s.push_text(&rest);
            rest = d.emit;
            if d.finished.is_none() {
                rest.push_str(&s.flush());
            }
        }
        rest
    }

    /// Runs to the end: the whole text, logprobs and finish reason.
    pub async fn collect(&mut self) -> Result<Collected, Error> {
        let mut text = String::new();
        let mut logprobs = Vec::new();
        let finish = loop {
            match self.step().await? {
                Event::Piece(p) => {
                    text.push_str(&p.text);
                    logprobs.extend(p.logprob);
                    if let Some(f) = p.finish {
                        // A stop string: dropping the run cancels the worker.
                        break f;
                    }
                }
                Event::End(f) => {
                    text.push_str(&self.flush());
                    break f;
                }
            }
        };
        Ok(Collected { text, logprobs, finish })
    }
}

#[cfg(test)]
mod tests {
    use super::MoveReason;

    #[test]
    fn every_move_reason_is_a_listed_label() {
        for r in MoveReason::ALL {
            assert!(facts::metrics::coordinator::MIGRATION_REASONS.contains(&r.as_str()), "{r:?}");
        }
        assert_eq!(MoveReason::ALL.len(), facts::metrics::coordinator::MIGRATION_REASONS.len());
    }
}
