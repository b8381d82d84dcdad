//! A request's walk, in the one order every frontend follows, cheapest refusal
//! first. Each step takes what the one before returned, so a frontend cannot
//! skip one or take them out of order:
//!
//! 1. **Key**: the API key names the caller and its tenant (401).
//! 2. **Tenant limits**: the tenant's requests in flight and its request rate
//!    (429) — [`Pipeline::enter`] does 1 and 2 and returns an [`Entered`].
//! 3. **Retries**: a request refused before with a `Retry-After` (known by its
//!    key, else its body) is refused cheaply while that is not up, and spends
//!    its caller's retry budget after ([`Entered::pace`], [`crate::retries`]).
//! 4. **Idempotency**: a retry with a key already seen is answered from the
//!    first request with it, live or recorded ([`Entered::claim`]); nothing
//!    below runs for it.
//! 5. **Validation**: the frontend parses its own request shape into a
//!    [`Draft`] (400 naming the field).
//! 6. **Tokenization**: [`Pipeline::prepare`] checks the tenant's caps and
//!    budgets around templating and tokenizing the prompt in the pool, checks
//!    the context, and assigns the seed: a [`Job`].
//! 7. **Admission**: the central queue, by class and fairness (429, 503, 504).
//! 8. **Route**: a decode worker with headroom and, for a long prompt, the
//!    prefill workers of its group — the one local-vs-remote decision, sent to
//!    the decode worker with the request. [`Pipeline::run`] does 7 and 8.
//!
//! Every answer with a `Retry-After` is remembered for step 3
//! ([`crate::retries::RetryGate::refused`]) by the frontend that sends it.
//!
//! After that the [`Run`](super::Run) streams; its worker may change under it
//! (request migration), never its admission seat or tenant charge.

use std::sync::Arc;

use axum::http::HeaderMap;
use tokio::time::Instant;

use super::Pipeline;
use crate::error::Error;
use crate::idempotency::{self, Claim, Idempotency, Recorder, Replay};
use crate::retries::Identity;
use crate::tenants::Pass;

/// A request that passed its key and its tenant's limits (steps 1 and 2).
#[derive(Debug)]
pub struct Entered {
    /// Its place inside its tenant's limits, held until the request ends.
    pub pass: Pass,
    /// When it arrived (latency metrics and the deadline count from here).
    pub arrived: Instant,
}

/// Step 4's outcome.
pub enum Claimed<R> {
    /// Run it: validation and what follows. With a key, what it sends is
    /// recorded for the retries that follow it.
    Fresh { entered: Entered, key: Option<String>, recorder: Option<Recorder<R>> },
    /// A retry of a request with the same key and body: its answer.
    Replay(Replay<R>),
}

impl Pipeline {
    /// Steps 1 and 2: the caller named by its key in `credentials` (HTTP
    /// headers or gRPC metadata) and its tenant's in-flight and rate limits.
    pub fn enter(&self, credentials: &HeaderMap) -> Result<Entered, Error> {
        let arrived = Instant::now();
        let pass = self.gate.enter(credentials)?;
        Ok(Entered { pass, arrived })
    }
}

impl Entered {
    /// Step 3: a retry of a request refused with a `Retry-After` (`id`: the
    /// caller and the request's key or body) is refused while that is not up,
    /// and beyond its caller's retry budget.
    pub fn pace(self, p: &Pipeline, id: &Identity) -> Result<Entered, Error> {
        p.retries.check(id)?;
        Ok(self)
    }

    /// Step 4: with an idempotency `key`, the request (`digest`: its body and
    /// endpoint) is either the first with that key for this caller — it runs,
    /// and what it sends is recorded — or a retry, answered from the first.
    /// A key reused with another body is refused (422); a full key table too
    /// (503), never a silent second run.
    /// `param` names the key's header or field in errors.
    pub fn claim<R: Clone>(
        self,
        table: &Arc<Idempotency<R>>,
        key: Option<&str>,
        param: &'static str,
        digest: &[u8],
    ) -> Result<Claimed<R>, Error> {
        let Some(k) = key else { return Ok(Claimed::Fresh { entered: self, key: None, recorder: None }) };
        if k.is_empty() || k.len() > idempotency::MAX_KEY_LEN {
            return Err(Error::invalid(param, format!("must be 1..={} bytes", idempotency::MAX_KEY_LEN)));
        }
        match table.claim(self.pass.caller(), k, idempotency::fingerprint(digest)) {
            Claim::Leader(r) => Ok(Claimed::Fresh { entered: self, key: Some(k.to_owned()), recorder: Some(r) }),
            Claim::Follower(replay) => Ok(Claimed::Replay(replay)),
            Claim::Conflict => Err(Error::IdempotencyKeyReused),
            Claim::Full => Err(Error::IdempotencyTableFull),
        }
    }
}
