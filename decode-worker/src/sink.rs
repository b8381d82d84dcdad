//! Where received KV lands: the decode worker's pool, which the engine
//! thread owns. The transport hands each accepted frame's payload over by
//! value; the sink posts the write to the engine thread without waiting
//! ([`RunnerHandle::post_pool`]), so the transport never stalls behind a
//! decode step while it holds the receiver, and no byte is copied twice.
//!
//! What waits for the engine is bounded by a credit: a write holds
//! [`units`] of [`CREDIT_UNITS`] (one per 64 KiB of payload, at least one)
//! from before it is posted until it has run (or was dropped unrun), so at
//! most [`CREDIT_BYTES`] (64 MiB) and [`CREDIT_UNITS`] writes wait — within
//! the runner's [`POST_ROOM`]. The server waits for the credit in
//! [`BlockSink::poll_ready`], before it takes the receiver: while the engine
//! is behind, the connection stops reading and TCP (or the local ring)
//! pushes back on the prefill worker. Nothing waits while holding anything
//! the engine needs, so this cannot deadlock: the engine thread only ever
//! returns credit. 64 MiB is about one 2,800-token prompt of SmolLM2-135M
//! (23 KiB of KV per token): a transfer waits only when more than that
//! arrives within one engine step.
//!
//! Ordering is what makes this safe. The transport posts the write while it
//! holds the receiver's lock, right after `Receiver::on_layer` accepted the
//! frame; any later end of that reservation (release of its blocks, or
//! `take_ready` followed by `submit_prefilled`) is sent to the engine
//! thread after it, and the engine thread runs commands in order. So a
//! write always lands before its blocks are freed or read.
//!
//! A write that fails on the engine thread (never expected: the receiver
//! checked the range) is told to the receiver, which holds all of a
//! reservation's state ([`Receiver::on_write_failed`]): a live reservation
//! fails there; for a taken one the service asks
//! [`Receiver::take_write_failure`] on the engine thread, after every
//! write and before joining the sequence, and treats a hit as corrupt KV.
//! The engine thread takes the receiver's lock only for that call, and no
//! holder of that lock ever waits for the engine thread (posts never wait),
//! so this cannot deadlock.

use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};

use engine::runner::{PostError, RunnerHandle, POST_ROOM};
use kvtransfer::{BlockSink, OwnedPayload, Receiver, WriteInstruction};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::PollSemaphore;
use types::kv::BlockId;

/// Bytes of payload one credit unit stands for.
pub const CREDIT_UNIT_BYTES: usize = 64 << 10;
/// Credit units: one per queued write at least, so never more writes than
/// the runner keeps room for.
pub const CREDIT_UNITS: usize = POST_ROOM;
/// Most payload bytes posted to the engine thread and not yet written.
pub const CREDIT_BYTES: usize = CREDIT_UNITS * CREDIT_UNIT_BYTES;
// Each write holds at least one unit: never more writes waiting than the runner has room for.
const _: () = assert!(CREDIT_UNITS <= POST_ROOM);

/// Credit units a write of `payload_len` bytes holds: one per started 64
/// KiB, at least one, at most all (a frame larger than 64 MiB then waits
/// for the queue to empty rather than forever).
pub fn units(payload_len: usize) -> u32 {
    payload_len.div_ceil(CREDIT_UNIT_BYTES).clamp(1, CREDIT_UNITS) as u32
}

/// Posts accepted KV frames to the engine thread. Clones (one per
/// connection) share the credit.
pub struct RunnerSink {
    runner: RunnerHandle,
    /// Told of a failed write (weak: the sink must not keep it alive).
    receiver: Weak<Mutex<Receiver>>,
    credit: PollSemaphore,
    /// Taken by `poll_ready` for the frame about to be written.
    held: Option<OwnedSemaphorePermit>,
}

impl RunnerSink {
    pub fn new(runner: RunnerHandle, receiver: &Arc<Mutex<Receiver>>) -> Self {
        let credit = PollSemaphore::new(Arc::new(Semaphore::new(CREDIT_UNITS)));
        Self { runner, receiver: Arc::downgrade(receiver), credit, held: None }
    }
}

impl Clone for RunnerSink {
    fn clone(&self) -> Self {
        Self { runner: self.runner.clone(), receiver: self.receiver.clone(), credit: self.credit.clone(), held: None }
    }
}

impl BlockSink for RunnerSink {
    fn poll_ready(&mut self, cx: &mut Context<'_>, payload_len: usize) -> Poll<()> {
        let want = units(payload_len);
        if self.held.as_ref().is_some_and(|p| p.num_permits() == want as usize) {
            return Poll::Ready(());
        }
        // A credit taken for a frame the receiver then refused, of another size.
        self.held = None;
        match self.credit.poll_acquire_many(cx, want) {
            Poll::Ready(permit) => {
                // `None` only if the semaphore were closed, which nothing does.
                self.held = permit;
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }

    fn unready(&mut self) {
        self.held = None;
    }

    fn write_layer(&mut self, _layer: usize, _blocks: &[BlockId], _k: &[u8], _v: &[u8]) -> Result<(), String> {
        // Every transport passes payloads by value; a borrowed one could not
        // outlive this call on the way to the engine thread.
        Err("RunnerSink takes payloads only through write_layer_owned".into())
    }

    fn landed_in_place(&mut self, _w: &WriteInstruction, payload_len: usize) {
        // Already in the pool (the UCX direct path): nothing waits for the engine.
        crate::metrics::record_received(payload_len as u64);
    }

    fn write_layer_owned(&mut self, w: WriteInstruction, payload: OwnedPayload) -> Result<(), String> {
        let r = w.reservation;
        let receiver = self.receiver.clone();
        let len = (*payload).as_ref().len();
        // Every server polls `poll_ready` for this frame first; a caller that
        // did not gets the credit only if it is there now.
        let credit = match self.held.take() {
            Some(p) => p,
            None => self.credit.clone_inner().try_acquire_many_owned(units(len)).map_err(|_| {
                format!("no credit for a {len}-byte KV write: {CREDIT_BYTES} bytes already wait for the engine")
            })?,
        };
        let posted = self.runner.post_pool(move |pool| {
            let (k, v) = w.split_payload((*payload).as_ref());
            if let Err(e) = pool.scatter_layer(w.layer, &w.blocks, k, v) {
                tracing::error!(layer = w.layer, error = %e, "writing received KV into the pool failed");
                if let Some(rx) = receiver.upgrade() {
                    rx.lock().unwrap_or_else(|e| e.into_inner()).on_write_failed(r);
                }
            }
            // Returned once the write has run (or with the job, dropped unrun).
            drop(credit);
        });
        match posted {
            Ok(()) => {
                // Counted here, as the frame is accepted, not mirrored later from the receiver's
                // counters: a mirror lagged up to the reaper's 500 ms and missed a drained
                // worker's last transfer entirely (the rolling-drain drill's G3 saw 72 KiB
                // fewer received than sent).
                crate::metrics::record_received(len as u64);
                Ok(())
            }
            Err(e @ PostError::Full { .. }) => {
                tracing::warn!(error = %e, "KV write refused: the engine's command queue is full");
                Err(e.to_string())
            }
            Err(e @ PostError::Exited) => Err(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write holds one unit per started 64 KiB, at least one and at most
    /// all of them, so the units bound both the writes waiting (one each,
    /// within the runner's room for posts) and their bytes.
    #[test]
    fn credit_units_bound_writes_and_bytes() {
        assert_eq!(units(0), 1);
        assert_eq!(units(1), 1);
        assert_eq!(units(CREDIT_UNIT_BYTES), 1);
        assert_eq!(units(CREDIT_UNIT_BYTES + 1), 2);
        assert_eq!(units(1 << 20), 16);
        assert_eq!(units(CREDIT_BYTES), CREDIT_UNITS as u32);
        assert_eq!(units(usize::MAX), CREDIT_UNITS as u32, "a frame above the whole credit waits for all of it");
        assert_eq!(CREDIT_BYTES, 64 << 20);
    }
}
