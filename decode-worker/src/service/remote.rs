//! The remote half of a `Generate` (steps 3 and 4 of the walk in
//! [`super`]): reserve blocks, have a prefill worker fill them, and on a
//! failed KV load let the [`KvLoadFailurePolicy`] choose between prefilling
//! here, trying the next named prefill worker, or answering
//! `kv_load_failed`; with the absorbed-prefill budget for prefill workers
//! that refuse as overloaded.

use std::sync::atomic::Ordering;
use std::time::Duration;

use kvtransfer::{Reservation, ReservationState};
use proto::worker::v1::prefill_worker_client::PrefillWorkerClient;
use proto::worker::v1::{
    prefill_response, ErrorKind, FirstToken, GenerateRequest, KvDestination, PrefillAttempt, PrefillRequest,
    PrefillState, PrefillStatusRequest, PrefillTarget, WorkerError,
};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use types::kv::BlockId;
use worker_common::serve::{blocking, err, runner_err, unix_deadline};

use super::{lock, DecodeService, Failure, Pending, Remote};
use crate::metrics as m;
use crate::KvLoadFailurePolicy;

/// Most prefill workers a decode worker keeps a client for at once.
const MAX_PREFILL_CLIENTS: usize = 256;

/// Inserts `key` into a table of at most `cap` entries: when full, another entry goes to
/// make room (a client dropped so is connected again on its next use).
fn insert_bounded<V>(table: &mut std::collections::HashMap<String, V>, key: &str, value: V, cap: usize) {
    if table.len() >= cap && !table.contains_key(key) {
        if let Some(k) = table.keys().find(|k| k.as_str() != key).cloned() {
            table.remove(&k);
        }
    }
    table.insert(key.to_owned(), value);
}

impl DecodeService {
    /// Has a prefill worker fill a reservation, applying the policy on failure.
    pub(super) async fn remote(
        &self,
        req: &GenerateRequest,
        deadline: Option<Instant>,
        policy: KvLoadFailurePolicy,
        token: &CancellationToken,
        attempts_made: &mut Vec<PrefillAttempt>,
    ) -> Result<Remote, WorkerError> {
        let inner = &self.inner;
        let max = inner.settings.max_pending_remote;
        if inner.pending_remote.fetch_add(1, Ordering::SeqCst) >= max {
            inner.pending_remote.fetch_sub(1, Ordering::SeqCst);
            inner.pending_changed.notify_waiters();
            return Err(err(ErrorKind::Overloaded, format!("{max} requests are already waiting for remote KV")));
        }
        let _pending = Pending(inner);
        let attempts = match policy {
            KvLoadFailurePolicy::Retry => inner.settings.max_prefill_attempts.min(req.prefill.len()),
            _ => 1,
        };
        for (i, target) in req.prefill.iter().take(attempts).enumerate() {
            let failure = match self.attempt(req, target, deadline, token).await {
                Ok(loaded) => {
                    attempts_made.push(PrefillAttempt {
                        target: Some(target.clone()),
                        error: None,
                        reason: String::new(),
                    });
                    return Ok(loaded);
                }
                // Ours (deadline, cancel, no room here) or the request's: not the prefill worker's failure.
                Err(Failure::Fatal(e)) => return Err(e),
                Err(Failure::Load { reason, error }) => {
                    m::record_load_failure(reason);
                    tracing::info!(
                        request = %req.request_id, target = %target.grpc_addr, reason, error = %error.message,
                        %policy, "remote KV load failed"
                    );
                    attempts_made.push(PrefillAttempt {
                        target: Some(target.clone()),
                        error: Some(error.clone()),
                        reason: reason.to_owned(),
                    });
                    error
                }
            };
            let last = i + 1 == attempts;
            match policy {
                KvLoadFailurePolicy::Recompute if failure.kind() == ErrorKind::Overloaded => {
                    return self.absorb_or_refuse(req, target, &failure);
                }
                KvLoadFailurePolicy::Recompute => {
                    m::record_policy(policy, facts::metrics::decode::OUTCOME_RECOMPUTED);
                    return Ok(Remote::Recompute);
                }
                KvLoadFailurePolicy::Retry if !last => {
                    m::record_policy(policy, facts::metrics::decode::OUTCOME_RETRIED)
                }
                KvLoadFailurePolicy::Retry => {
                    m::record_policy(policy, facts::metrics::decode::OUTCOME_FAILED);
                    return Err(err(
                        ErrorKind::KvLoadFailed,
                        format!("KV load failed on all {attempts} prefill workers tried; last: {}", failure.message),
                    ));
                }
                KvLoadFailurePolicy::Fail => {
                    m::record_policy(policy, facts::metrics::decode::OUTCOME_FAILED);
                    let kind = match failure.kind() {
                        ErrorKind::VersionMismatch => ErrorKind::VersionMismatch,
                        _ => ErrorKind::KvLoadFailed,
                    };
                    return Err(err(kind, format!("KV load failed: {}", failure.message)));
                }
            }
        }
        // Only reached with no targets, which the route excludes.
        Err(err(ErrorKind::Internal, "no prefill worker to try"))
    }

    /// `recompute`, and the prefill worker refused the request as
    /// overloaded (busy, not broken): prefill here while the absorb budget
    /// lasts; past it, refuse as `overloaded` so the coordinator can shed
    /// with 503 + Retry-After, rather than slow every running stream down.
    fn absorb_or_refuse(
        &self,
        req: &GenerateRequest,
        target: &PrefillTarget,
        refusal: &WorkerError,
    ) -> Result<Remote, WorkerError> {
        let tokens = req.token_ids.len() + req.generated_ids.len();
        let cap = self.inner.settings.max_absorbed_prefill_tokens_per_s;
        let taken = lock(&self.inner.absorb).try_take(tokens, Instant::now());
        let policy = KvLoadFailurePolicy::Recompute;
        if taken {
            m::record_policy(policy, facts::metrics::decode::OUTCOME_OVERLOAD_ABSORBED);
            tracing::warn!(
                request = %req.request_id, prefill = %target.grpc_addr, reason = %refusal.message, tokens,
                cap_tokens_per_s = cap, "prefill worker overloaded: prefilling here (absorbed)"
            );
            return Ok(Remote::Recompute);
        }
        m::record_policy(policy, facts::metrics::decode::OUTCOME_OVERLOAD_REFUSED);
        tracing::warn!(
            request = %req.request_id, prefill = %target.grpc_addr, reason = %refusal.message, tokens,
            cap_tokens_per_s = cap, "prefill worker overloaded and the local absorb budget is spent: refusing as overloaded"
        );
        Err(err(
            ErrorKind::Overloaded,
            format!(
                "prefill worker {} is overloaded ({}), and this decode worker already prefills the most it takes \
                 over ({cap} tokens/s)",
                target.grpc_addr, refusal.message
            ),
        ))
    }

    /// One reservation and one `Prefill` call.
    async fn attempt(
        &self,
        req: &GenerateRequest,
        target: &PrefillTarget,
        deadline: Option<Instant>,
        token: &CancellationToken,
    ) -> Result<Remote, Failure> {
        let inner = &self.inner;
        let started = Instant::now();
        if deadline.is_some_and(|d| started >= d) {
            return Err(Failure::Fatal(err(ErrorKind::Deadline, "deadline passed before the KV load")));
        }
        let n = inner.runner.blocks_for(req.token_ids.len() + req.generated_ids.len());
        let runner = inner.runner.clone();
        let blocks = blocking(move || runner.reserve(n))
            .await
            .map_err(Failure::Fatal)?
            .map_err(|e| Failure::Fatal(runner_err(&e)))?;
        let reserved = lock(&inner.receiver).reserve(blocks.clone(), inner.settings.reservation_ttl, started);
        let r = match reserved {
            Ok(r) => r,
            Err(e) => {
                self.release(blocks).await;
                return Err(Failure::Fatal(err(ErrorKind::Overloaded, format!("KV reservation refused: {e}"))));
            }
        };
        let result = self.call_prefill(req, target, r, &blocks, deadline, token).await;
        let first = match result {
            Ok(first) => first,
            Err(f) => {
                // Expire first, so a lease that ran out is named as such.
                self.reap().await;
                let f = self.classify(r, f);
                self.end_reservation(r).await;
                return Err(f);
            }
        };
        let taken = lock(&inner.receiver).take_ready(r);
        // Exported now, not at the next reap (up to 500 ms later): a scrape made
        // after this request's answer must already count its transfer as completed.
        self.export_receiver();
        let blocks = match taken {
            Ok(b) => b,
            Err(e) => {
                let f = self.classify(
                    r,
                    Failure::Load { reason: "incomplete", error: err(ErrorKind::KvLoadFailed, e.to_string()) },
                );
                self.end_reservation(r).await;
                return Err(f);
            }
        };
        // Barrier: runs on the engine thread after every posted write of r.
        let (runner, receiver) = (inner.runner.clone(), inner.receiver.clone());
        let failed = blocking(move || runner.with_pool(move |_| lock(&receiver).take_write_failure(r)))
            .await
            .map_err(Failure::Fatal)?
            .map_err(|e| Failure::Fatal(runner_err(&e)));
        match failed {
            Ok(false) => {
                m::record_load(started.elapsed().as_secs_f64());
                Ok(Remote::Loaded(blocks, first))
            }
            Ok(true) => {
                self.release(blocks).await;
                Err(Failure::Load {
                    reason: "corrupt",
                    error: err(ErrorKind::KvLoadFailed, "a KV write into the pool failed"),
                })
            }
            Err(f) => {
                self.release(blocks).await;
                Err(f)
            }
        }
    }

    /// Names a load failure after what the receiver saw, which is more
    /// precise than the prefill worker's view (a checksum failure or an
    /// expired lease there is just an `Abort` from us).
    fn classify(&self, r: Reservation, f: Failure) -> Failure {
        let Failure::Load { reason, error } = f else { return f };
        let reason = match lock(&self.inner.receiver).state(r) {
            Some(ReservationState::Failed) => "corrupt",
            Some(ReservationState::Expired) => "lease_expired",
            _ => reason,
        };
        Failure::Load { reason, error }
    }

    fn client(&self, addr: &str) -> Result<PrefillWorkerClient<Channel>, WorkerError> {
        let mut clients = lock(&self.inner.clients);
        if let Some(c) = clients.get(addr) {
            return Ok(c.clone());
        }
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| err(ErrorKind::InvalidArgument, format!("prefill grpc_addr {addr:?}: {e}")))?
            .connect_timeout(Duration::from_secs(5))
            .tcp_nodelay(true);
        let c = PrefillWorkerClient::new(endpoint.connect_lazy());
        insert_bounded(&mut clients, addr, c.clone(), MAX_PREFILL_CLIENTS);
        Ok(c)
    }

    /// Forgets the client of a prefill worker whose address stopped answering: one that
    /// restarted listens at another address, so clients of dead addresses would
    /// otherwise pile up for this worker's life (found by `tandem chaos`'s memory check).
    fn forget_client(&self, addr: &str) {
        lock(&self.inner.clients).remove(addr);
    }

    /// The `Prefill` call, bounded by the request's deadline and by the
    /// reservation's lease, which [`Self::hold_lease`] renews while the
    /// prefill worker reports the prompt queued.
    async fn call_prefill(
        &self,
        req: &GenerateRequest,
        target: &PrefillTarget,
        r: Reservation,
        blocks: &[BlockId],
        deadline: Option<Instant>,
        token: &CancellationToken,
    ) -> Result<FirstToken, Failure> {
        let inner = &self.inner;
        let mut client = self.client(&target.grpc_addr).map_err(Failure::Fatal)?;
        let status_client = client.clone();
        // The request's own deadline: the prefill worker may queue the prompt
        // for longer than a lease, and drops it when this call goes away.
        let call = PrefillRequest {
            request_id: req.request_id.clone(),
            token_ids: req.token_ids.clone(),
            sampling: req.sampling.clone(),
            deadline_unix_ms: unix_deadline(deadline),
            cache_salt: req.cache_salt,
            priority: req.priority,
            generated_ids: req.generated_ids.clone(),
            determinism_fingerprint: worker_common::serve::determinism(&inner.local.fingerprint).to_vec(),
            destination: Some(KvDestination {
                transfer_addr: inner.settings.transfer_addr.clone(),
                transport: inner.settings.transport.as_str().into(),
                reservation_id: r.id.0,
                generation: r.generation,
                block_ids: blocks.to_vec(),
                layout_fingerprint: inner.local.fingerprint.as_bytes().to_vec(),
                version_group: inner.local.version_group.as_str().to_owned(),
                tls_cert_sha256: inner.settings.tls_cert_sha256.map(|f| f.to_vec()).unwrap_or_default(),
            }),
        };
        let load = |reason, kind, message: String| Failure::Load { reason, error: err(kind, message) };
        // Dropping the call (timeout, cancel) resets its HTTP/2 stream, which
        // cancels the prefill worker's handler and frees its KV there.
        let answer = tokio::select! {
            a = client.prefill(call) => Some(a),
            () = self.hold_lease(status_client, &req.request_id, r, deadline) => None,
            _ = token.cancelled() => return Err(Failure::Fatal(err(ErrorKind::Cancelled, "aborted"))),
        };
        let deadline_passed = || deadline.is_some_and(|d| Instant::now() >= d);
        let Some(answer) = answer else {
            if deadline_passed() {
                let e = err(ErrorKind::Deadline, "deadline passed while waiting for the remote prefill");
                return Err(Failure::Fatal(e));
            }
            return Err(load(
                "timeout",
                ErrorKind::KvLoadFailed,
                format!("no KV from {} within the reservation lease", target.grpc_addr),
            ));
        };
        match answer {
            Err(status) => {
                if status.code() == tonic::Code::Unavailable {
                    self.forget_client(&target.grpc_addr);
                }
                Err(load(
                    "rpc",
                    ErrorKind::Retryable,
                    format!("Prefill on {}: {} ({:?})", target.grpc_addr, status.message(), status.code()),
                ))
            }
            Ok(resp) => match resp.into_inner().outcome {
                Some(prefill_response::Outcome::FirstToken(first)) => Ok(first),
                Some(prefill_response::Outcome::Error(e)) => match e.kind() {
                    ErrorKind::InvalidArgument => Err(Failure::Fatal(e)),
                    ErrorKind::Deadline if deadline_passed() => Err(Failure::Fatal(e)),
                    ErrorKind::VersionMismatch => Err(Failure::Load { reason: "version_mismatch", error: e }),
                    _ => Err(Failure::Load { reason: "prefill_error", error: e }),
                },
                None => Err(load("prefill_error", ErrorKind::Internal, "Prefill answered no outcome".into())),
            },
        }
    }

    /// Returns once reservation `r`'s lease has run out or the request's
    /// deadline has passed; the `Prefill` call runs beside it and, when it
    /// answers first, this is dropped.
    ///
    /// Every third of `reservation_ttl_ms` it asks the prefill worker where
    /// the prompt is (`PrefillStatus`): while the answer is `QUEUED`, the
    /// lease is renewed to a full TTL from now, so a prompt waiting behind
    /// others on a busy prefill worker keeps its blocks however long its
    /// turn takes (admission and `--max-waiting` bound that queue, not the
    /// lease). The first `RUNNING` after `QUEUED` renews once more — the
    /// transfer gets a whole lease from (at most a period after) its start —
    /// and the probing stops. No answer within a period renews nothing: a
    /// stopped or unreachable prefill worker's reservation expires one TTL
    /// after its last renewal, as it always did. A worker without the RPC
    /// (`UNIMPLEMENTED`) is not asked again: its leases count from the
    /// reservation, as before the RPC existed.
    ///
    /// A reservation that ended otherwise (a corrupt frame, the sender's
    /// abort) is explained by the call's answer, which gets one more TTL.
    async fn hold_lease(
        &self,
        mut client: PrefillWorkerClient<Channel>,
        request_id: &str,
        r: Reservation,
        deadline: Option<Instant>,
    ) {
        let inner = &self.inner;
        let ttl = inner.settings.reservation_ttl;
        let period = ttl / 3;
        let mut probe_at = Some(Instant::now() + period);
        let mut queued = false;
        let mut ended_at = None;
        loop {
            let now = Instant::now();
            let (end, state) = {
                let rx = lock(&inner.receiver);
                (rx.lease_end(r), rx.state(r))
            };
            let end = match (end, state) {
                (Some(end), _) => end,
                (None, Some(ReservationState::Expired) | None) => return,
                (None, Some(_)) => {
                    probe_at = None;
                    *ended_at.get_or_insert(now + ttl)
                }
            };
            let stop = deadline.map_or(end, |d| d.min(end));
            if now >= stop {
                return;
            }
            let Some(at) = probe_at.filter(|&at| at < stop) else {
                tokio::time::sleep_until(stop).await;
                continue;
            };
            tokio::time::sleep_until(at).await;
            let ask = PrefillStatusRequest { request_id: request_id.to_owned() };
            let answer = tokio::time::timeout_at((at + period).min(stop), client.prefill_status(ask)).await;
            probe_at = Some(at + period);
            let renew = match answer {
                Ok(Ok(a)) => match a.into_inner().state() {
                    PrefillState::Queued => {
                        queued = true;
                        true
                    }
                    PrefillState::Running => {
                        probe_at = None;
                        queued
                    }
                    PrefillState::Unknown | PrefillState::Unspecified => {
                        probe_at = None;
                        false
                    }
                },
                Ok(Err(status)) if status.code() == tonic::Code::Unimplemented => {
                    probe_at = None;
                    false
                }
                Ok(Err(_)) | Err(_) => false,
            };
            if renew && lock(&inner.receiver).renew(r, ttl, Instant::now()).is_ok() {
                m::record_lease_renewal();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefill_client_table_stays_within_its_cap() {
        let mut t = std::collections::HashMap::new();
        for i in 0..10 {
            insert_bounded(&mut t, &format!("10.0.0.{i}:50052"), i, 4);
            assert!(t.len() <= 4, "{t:?}");
            assert_eq!(t.get(&format!("10.0.0.{i}:50052")), Some(&i), "the new one is in");
        }
        insert_bounded(&mut t, "10.0.0.9:50052", 99, 4);
        assert_eq!((t.len(), t.get("10.0.0.9:50052")), (4, Some(&99)), "a known key replaces, evicting nothing");
    }
}
