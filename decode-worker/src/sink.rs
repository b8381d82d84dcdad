//! Where received KV lands: the decode worker's pool, which the engine
//! thread owns. The transport hands each accepted frame's payload over by
//! value; the sink posts the write to the engine thread without waiting
//! ([`RunnerHandle::post_pool`]), so the transport never stalls behind a
//! decode step and no byte is copied twice.
//!
//! Ordering is what makes this safe. The transport posts the write while it
//! holds the receiver's lock, right after `Receiver::on_layer` accepted the
//! frame; any later end of that reservation (release of its blocks, or
//! `take_ready` followed by `submit_prefilled`) is sent to the engine
//! thread after it, and the engine thread runs commands in order. So a
//! write always lands before its blocks are freed or read.
//!
//! A write that fails on the engine thread (never expected: the receiver
//! checked the range) is recorded against its reservation; the service
//! checks [`WriteFailures::take`] on the engine thread, after every write
//! and before joining the sequence, and treats a hit as corrupt KV.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use engine::kv::BlockId;
use engine::runner::RunnerHandle;
use kvtransfer::{BlockSink, OwnedPayload, Reservation, WriteInstruction};

/// Reservations with a failed write, shared by the sink and the service.
#[derive(Debug, Clone, Default)]
pub struct WriteFailures(Arc<Mutex<HashSet<Reservation>>>);

impl WriteFailures {
    fn add(&self, r: Reservation) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).insert(r);
    }

    /// Whether a write for `r` failed (and forgets it). Call on the engine
    /// thread (inside `with_pool`) so every posted write has run.
    pub fn take(&self, r: Reservation) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(&r)
    }
}

/// Posts accepted KV frames to the engine thread.
#[derive(Clone)]
pub struct RunnerSink {
    pub runner: RunnerHandle,
    pub failures: WriteFailures,
}

impl BlockSink for RunnerSink {
    fn write_layer(&mut self, _layer: usize, _blocks: &[BlockId], _k: &[u8], _v: &[u8]) -> Result<(), String> {
        // Every transport passes payloads by value; a borrowed one could not
        // outlive this call on the way to the engine thread.
        Err("RunnerSink takes payloads only through write_layer_owned".into())
    }

    fn write_layer_owned(&mut self, w: WriteInstruction, payload: OwnedPayload) -> Result<(), String> {
        let r = w.reservation;
        let failures = self.failures.clone();
        let bytes = (*payload).as_ref().len() as u64;
        let posted = self.runner.post_pool(move |pool| {
            let (k, v) = w.split_payload((*payload).as_ref());
            if let Err(e) = pool.scatter_layer(w.layer, &w.blocks, k, v) {
                tracing::error!(layer = w.layer, error = %e, "writing received KV into the pool failed");
                failures.add(r);
            }
        });
        if posted {
            // Counted here, as the frame is accepted, not mirrored later from the receiver's
            // counters: a mirror lagged up to the reaper's 500 ms and missed a drained
            // worker's last transfer entirely (the rolling-drain drill's G3 saw 72 KiB
            // fewer received than sent).
            crate::metrics::record_received(bytes);
            Ok(())
        } else {
            Err("the engine thread has exited".into())
        }
    }
}
