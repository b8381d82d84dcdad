//! Drills only (the `fault-injection` feature): a bug planted on purpose, so that a
//! chaos run can show its invariants catch it (`tandem chaos --plant`).
//!
//! The endless stream: the N-th streamed HTTP answer this coordinator starts (1-based;
//! 0 is off) sends its tokens and then never ends, holding the connection open without
//! its finish event or `[DONE]` until the client goes away: the hang every invariant
//! about deadlines must catch, past the coordinator's own deadline enforcement.

use std::sync::atomic::{AtomicU64, Ordering};

static ENDLESS_AT: AtomicU64 = AtomicU64::new(0);
static STREAMS: AtomicU64 = AtomicU64::new(0);

/// Arms the endless stream at the `at`-th streamed answer (0: off).
pub fn arm(at: u64) {
    ENDLESS_AT.store(at, Ordering::SeqCst);
}

/// Whether the streamed answer starting now is the endless one.
pub fn endless_now() -> bool {
    let n = STREAMS.fetch_add(1, Ordering::SeqCst) + 1;
    ENDLESS_AT.load(Ordering::SeqCst) == n
}
