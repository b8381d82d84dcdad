//! The workers' slow heap tick: every [`RELEASE_EVERY`] the allocator's free
//! pages go back to the kernel.
//!
//! Why: glibc keeps the pages of freed chunks that lie between live ones, in
//! every arena, for good. A worker's working set moves around its heap with
//! the load (a fault that held more requests in flight, a burst of long
//! prompts, a peer that stalled a transfer), so its resident memory ratchets
//! up while its live heap stays flat: a chaos run measured the decode
//! worker's live heap (heaptrack) flat at 29 MB for its last 20 minutes while
//! its `RssAnon` rose 1.3 MiB per 10 minutes, over the bound an SRE's memory
//! alert would use for a leak. Gathered KV buffers are released as they decay
//! (kvtransfer's `buffers`); this tick covers every other allocation.
//!
//! A release walks every arena under its lock, about a millisecond for a
//! worker's heap, on a blocking thread, twice a minute: nothing a step notices.

use std::time::Duration;

use facts::metrics::worker::HEAP_RELEASED_BYTES;

/// How often a worker gives free pages back.
pub const RELEASE_EVERY: Duration = Duration::from_secs(30);

/// Starts the tick on the current runtime; it ends with the runtime.
pub fn spawn_release(every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is at once: nothing has been freed yet.
        tick.tick().await;
        loop {
            tick.tick().await;
            match tokio::task::spawn_blocking(release).await {
                Ok(kib) => metrics::counter!(HEAP_RELEASED_BYTES).increment(kib * 1024),
                Err(_) => return,
            }
        }
    })
}

/// Gives the allocator's free pages back; returns the KiB of `RssAnon` that
/// went (0 where it could not be read, or other threads allocated meanwhile
/// more than was given back).
pub fn release() -> u64 {
    let before = rss_anon_kib();
    kvtransfer::buffers::release_free_pages();
    before.zip(rss_anon_kib()).map_or(0, |(b, a)| b.saturating_sub(a))
}

/// This process's resident anonymous memory, KiB, from /proc.
fn rss_anon_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Small allocations (not buffers) freed between survivors on a thread of their own,
    /// as a worker's request state is: `free` keeps their pages, a release gives them back
    /// and counts what went.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_release_gives_back_the_holes_and_counts_them() {
        let run = std::thread::spawn(|| {
            // 48 MiB of 1 KiB chunks (under glibc's mmap threshold: heap, not mappings).
            let mut all: Vec<Box<[u8]>> = (0..48 << 10).map(|i| vec![i as u8 | 1; 1024].into_boxed_slice()).collect();
            // One chunk in sixteen (a page in four) survives, so the arena's top cannot shrink.
            let kept: Vec<Box<[u8]>> = all.iter_mut().step_by(16).map(std::mem::take).collect();
            let held = rss_anon_kib().unwrap_or(0);
            drop(all);
            let freed = rss_anon_kib().unwrap_or(0);
            let released = release();
            let after = rss_anon_kib().unwrap_or(0);
            (kept, held, freed, released, after)
        })
        .join();
        let Ok((kept, held, freed, released, after)) = run else { panic!("the allocating thread panicked") };
        assert_eq!(kept.len(), 3 << 10);
        assert!(held >= 44 << 10, "48 MiB were resident: {held} KiB");
        assert!(freed + (8 << 10) >= held, "free alone kept most of it resident: {held} -> {freed} KiB");
        assert!(released >= 24 << 10, "the release gave back the holes: {freed} -> {after} KiB, counted {released}");
        assert!(after + released <= freed + (1 << 10), "what it counted went: {freed} -> {after}, counted {released}");
    }
}
