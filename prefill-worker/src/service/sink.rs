//! How a streaming prefill's layers leave the engine: the sink that runs on the engine
//! thread mid-step (stored in place by a ucx direct writer, checksummed where it lies for
//! a tcp send from the pool, or gathered into a recycled buffer) and what it hands the
//! push.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use engine::batch::LayerView;
use kvtransfer::{Buffer, Buffers, PinnedLayer, StoredLayer, UcxDirectWriter};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use types::kv::KvLayout;

/// A streaming prefill's layers on their way from the engine to the push.
pub(super) struct Streams {
    pub(super) layers: mpsc::Receiver<Streamed>,
    /// Where the push puts the transport's direct writer, for the sink.
    pub(super) writer: Arc<OnceLock<UcxDirectWriter>>,
}

/// One layer's run of blocks, as the engine's sink handed it over.
pub(super) enum Streamed {
    /// Gathered into recycled buffers, for the push to send.
    Gathered(Gathered),
    /// Checksummed where it lies in the pool's mapped memory, for the push to send
    /// from there (tcp).
    Pinned(PinnedLayer),
    /// Already stored in the decode worker's pool by a direct writer, for
    /// the push to announce.
    Stored(StoredLayer),
}

/// One layer's run of blocks gathered by the engine's sink.
pub(super) struct Gathered {
    pub(super) layer: usize,
    pub(super) first_block: usize,
    pub(super) k: Buffer,
    pub(super) v: Buffer,
}

/// Gathers `view`'s blocks into buffers from `buffers`.
fn gather(view: &LayerView<'_>, buffers: &Buffers) -> Result<Gathered, engine::kv::KvError> {
    let (mut k, mut v) = (buffers.take(), buffers.take());
    view.gather_into(&mut k, &mut v)?;
    Ok(Gathered { layer: view.layer, first_block: view.first_block, k, v })
}

/// When a tcp layer goes out straight from the pool ([`PinnedLayer`]): only a layer of
/// the prompt's last step, the run that ends at its last block. Once that step is done
/// the request is held, never preempted, and its blocks stay its own until its push has
/// ended (they are released after it). An earlier step's blocks are not so safe: a
/// preempted prefill gives all its blocks back and the engine does not send what it
/// already streamed again, so a layer still queued would name blocks another request may
/// have written by then (the decode side would refuse it by its checksum, failing the
/// transfer). Those layers are gathered, as before.
#[derive(Debug, Clone, Copy)]
pub(super) struct Pin {
    pub(super) layout: KvLayout,
    pub(super) max_frame_bytes: usize,
    /// Blocks the whole prompt takes.
    pub(super) prompt_blocks: usize,
}

impl Pin {
    /// Whether a run of `n` blocks from `first_block` is of the prompt's last step.
    fn last_step(&self, first_block: usize, n: usize) -> bool {
        first_block + n == self.prompt_blocks
    }
}

/// The engine's sink for one streaming prefill: blocks into `tx`, never
/// waiting (it runs on the engine thread, mid-step). Once the push has a
/// direct writer in `writer`, each layer is stored by it straight into the
/// decode worker's pool from the engine's (no gather, one copy) and only
/// what was stored goes into `tx`; before that, or should a store fail (a
/// revoked grant: the push is failing anyway), the layer is gathered. `tx`
/// is deep enough for every message of the prompt, so it is never full;
/// should the engine ever break that bound, the stream is cut instead of
/// waiting or leaving a gap: the push sees the end, counts fewer bytes than
/// the prompt has, and aborts the transfer. A closed `tx` (the push is
/// gone; the request is being aborted) drops the blocks.
pub(super) fn layer_sink(
    tx: mpsc::Sender<Streamed>,
    computing: Arc<AtomicBool>,
    writer: Arc<OnceLock<UcxDirectWriter>>,
    buffers: Buffers,
    pin: Option<Pin>,
) -> engine::batch::LayerSink {
    let mut tx = Some(tx);
    Box::new(move |view: LayerView<'_>| {
        computing.store(true, Ordering::Relaxed);
        let Some(t) = &tx else { return };
        if t.is_closed() {
            return;
        }
        let stored = writer.get().and_then(|w| {
            let (k, v) = view.pool.layer_bytes(view.layer).ok()?;
            w.store_layer(view.layer, view.first_block, k, v, view.blocks)
                .inspect_err(|e| tracing::debug!(error = %e, "direct store refused; gathering the layer"))
                .ok()
        });
        let pinned = || {
            let p = pin.filter(|p| p.last_step(view.first_block, view.blocks.len()))?;
            let (k, v) = view.pool.layer_bytes(view.layer).ok()?;
            PinnedLayer::new(&p.layout, view.layer, view.first_block, view.blocks, k, v, p.max_frame_bytes)
                .inspect_err(|e| tracing::debug!(error = %e, "checksumming a layer in place refused; gathering it"))
                .ok()
        };
        let item = match stored.map(Streamed::Stored).or_else(|| pinned().map(Streamed::Pinned)) {
            Some(item) => item,
            None => match gather(&view, &buffers) {
                Ok(c) => Streamed::Gathered(c),
                Err(e) => {
                    // Never expected (the blocks are the sequence's own): cut the
                    // stream, so the push counts a short prompt and aborts.
                    tracing::error!(layer = view.layer, error = %e, "gathering streamed KV failed; cutting its stream");
                    tx = None;
                    return;
                }
            },
        };
        if let Err(TrySendError::Full(_)) = t.try_send(item) {
            tracing::error!(capacity = t.max_capacity(), "a prefill's KV queue is full; cutting its stream");
            tx = None;
        }
    })
}
