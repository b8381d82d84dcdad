//! Drills only (the `fault-injection` feature): bugs planted on purpose, so that a
//! chaos run can show its invariants catch them (`tandem chaos --plant`,
//! `--plant-on-move`).
//!
//! The endless stream: the N-th streamed HTTP answer this coordinator starts (1-based;
//! 0 is off) sends its tokens and then never ends, holding the connection open without
//! its finish event or `[DONE]` until the client goes away: the hang every invariant
//! about deadlines must catch, past the coordinator's own deadline enforcement.
//!
//! The lost token on a move: a request moved to another decode worker (its worker
//! killed or frozen mid-stream) never sends the client the first token the new
//! worker generates — an off-by-one in request migration. Only a fault that moves
//! a stream sets it off, so a chaos run that catches it can be shrunk to the
//! faults that do (`tandem chaos --shrink`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static ENDLESS_AT: AtomicU64 = AtomicU64::new(0);
static STREAMS: AtomicU64 = AtomicU64::new(0);
static MOVE_DROPS_TOKEN: AtomicBool = AtomicBool::new(false);

/// Arms the endless stream at the `at`-th streamed answer (0: off).
pub fn arm(at: u64) {
    ENDLESS_AT.store(at, Ordering::SeqCst);
}

/// Whether the streamed answer starting now is the endless one.
pub fn endless_now() -> bool {
    let n = STREAMS.fetch_add(1, Ordering::SeqCst) + 1;
    ENDLESS_AT.load(Ordering::SeqCst) == n
}

/// Arms (or disarms) the lost token on a move.
pub fn arm_move_drops_token(on: bool) {
    MOVE_DROPS_TOKEN.store(on, Ordering::SeqCst);
}

/// Whether a request that just moved drops its new worker's first token.
pub fn move_drops_token() -> bool {
    MOVE_DROPS_TOKEN.load(Ordering::SeqCst)
}
