//! Cost of one routing + admission decision with 1,000 registered workers
//! (500 decode, 500 prefill, fake load on the board), against a baseline
//! measured in the same run. `cargo bench -p coordinator --bench route`.
//!
//! - decision: `Admission::admit` (a free slot), `Cluster::route` for a
//!   235-token prompt (a fleet this size is sampled: 16 decode workers drawn
//!   at random and 16 prefill workers of their group, see
//!   `cluster/listing.rs`; power of two choices over those prefill workers,
//!   fallbacks sorted), and the slot dropped;
//! - prefix decision: the same with `Cluster::route_for`, the prompt matched
//!   against the prefix index while every worker holds 512 blocks of other
//!   prompts and 6 decode workers hold all 14 of this one's full blocks (who
//!   wins is asserted: one of those 6);
//! - baseline: one pass over the same 1,000 load-board entries (one read
//!   lock, a look-up per worker) reading each worker's queue: the least a
//!   router that weighs every worker's load must do (a ratio under 1: the
//!   sample does less).
//!
//! Every one of the 250,000 (prefill, decode) pairs has reported to its
//! circuit breaker, and 10 pairs are open, so the decision pays for
//! breakers as a busy cluster's does (it reads only the pairs not closed).
//!
//! The workers are fixed addresses (`Source::Static`): the candidate lists
//! and the router are the same code as with etcd membership, whose view is
//! an in-memory map read the same way.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]
#![forbid(unsafe_code)]

use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant as Clock};
use types::priority::Priority;

use coordinator::admission::{Admission, AdmissionConfig, Ticket};
use coordinator::breaker::{BreakerConfig, Outcome, Pair};
use coordinator::cluster::{Cluster, RouteSettings, Source};
use coordinator::load::Load;
use tokio::time::Instant;

const WORKERS: usize = 1000;
const OPS: usize = 20_000;
const WARMUP: usize = 2_000;

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn report(name: &str, mut t: Vec<Duration>) -> (f64, f64) {
    t.sort_unstable();
    let (p50, p99) = (percentile(&t, 0.50), percentile(&t, 0.99));
    println!("{name:<10} p50 {p50:>8.2} us   p99 {p99:>8.2} us   ({} ops)", t.len());
    (p50, p99)
}

fn main() -> Result<(), Box<dyn Error>> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(run())
}

async fn run() -> Result<(), Box<dyn Error>> {
    let addr = |role: &str, i: usize| format!("{role}-{i}.invalid:{}", 7000 + i);
    let decode: Vec<String> = (0..WORKERS / 2).map(|i| addr("d", i)).collect();
    let prefill: Vec<String> = (0..WORKERS / 2).map(|i| addr("p", i)).collect();
    let cluster = Arc::new(Cluster::new(
        Source::Static { decode: decode.clone(), prefill: prefill.clone() },
        // Open pairs stay open for the whole run (no probes).
        RouteSettings {
            breaker: BreakerConfig { cooldown: Duration::from_secs(3600), ..BreakerConfig::default() },
            ..RouteSettings::default()
        },
    )?);
    // Fake load: every worker answered recently with a different queue and KV use. A
    // reading goes stale after 4 poll intervals (about 1 s), less than setting up the
    // 250,000 breakers or running the loops takes on a slow machine: so it is set again
    // before each loop and every 250 operations, outside the timed part (stale workers
    // would leave no route at all).
    let refresh = || {
        let now = Instant::now();
        for (i, a) in decode.iter().chain(&prefill).enumerate() {
            cluster.board().set(
                a,
                Load {
                    ready: true,
                    reachable: true,
                    kv_blocks_total: 1024,
                    kv_blocks_used: (i * 37 % 1024) as u32,
                    running: (i % 16) as u32,
                    waiting: (i % 5) as u32,
                    at: now,
                },
            );
        }
    };
    // Every pair reported a success; the first 10 decode workers' pairs with prefill-0 are open.
    for d in &decode {
        for p in &prefill {
            let pair = Pair { prefill_id: p, prefill_addr: p, decode_id: d, decode_addr: d };
            cluster.breakers().record(pair, Outcome::Success, "bench");
        }
    }
    for d in &decode[..10] {
        let p = &prefill[0];
        for _ in 0..BreakerConfig::default().failures {
            let pair = Pair { prefill_id: p, prefill_addr: p, decode_id: d, decode_addr: d };
            cluster.breakers().record(pair, Outcome::Failure, "bench");
        }
    }
    assert_eq!(cluster.breakers().len(), WORKERS * WORKERS / 4);
    let admission = Admission::new(AdmissionConfig { max_running: 64, ..AdmissionConfig::default() })?;

    let all: Vec<&String> = decode.iter().chain(&prefill).collect();
    let mut base = Vec::with_capacity(OPS);
    let mut sink = 0u64;
    for i in 0..OPS + WARMUP {
        if i % 250 == 0 {
            refresh();
        }
        let t = Clock::now();
        let loads = cluster.board().read();
        for a in &all {
            sink += loads.get(a).map_or(0, |l| u64::from(l.queue()));
        }
        drop(loads);
        if i >= WARMUP {
            base.push(t.elapsed());
        }
    }
    std::hint::black_box(sink);

    let mut decide = Vec::with_capacity(OPS);
    for i in 0..OPS + WARMUP {
        if i % 250 == 0 {
            refresh();
        }
        let ticket = Ticket {
            key: format!("key-{}", i % 1000),
            priority: Priority::Normal,
            cost: 235 + 64,
            deadline: Instant::now() + Duration::from_secs(60),
        };
        let t = Clock::now();
        let slot = admission.admit(ticket).await.map_err(|e| format!("admission refused: {e:?}"))?;
        let route = cluster.route(235).map_err(|e| e.to_string())?;
        drop(slot);
        let took = t.elapsed();
        // A dispatch's remote attempts are capped (3 by default): so is the list.
        assert_eq!(route.prefill.len(), 3, "decode worker {}", route.decode);
        if i >= WARMUP {
            decide.push(took);
        }
    }

    // The prefix index: 512 blocks of its own per worker, and the prompt's 14 full
    // blocks on 6 decode workers with empty queues (each 80th but the first).
    let prompt: Vec<u32> = (0..235).map(|t| 1_000 + t * 7).collect();
    let chain = engine::kv::prefix_hashes(&prompt, 16, 42);
    let holders: Vec<&String> = decode.iter().step_by(80).skip(1).collect();
    for (i, a) in decode.iter().chain(&prefill).enumerate() {
        let own = (0..512u64).map(|b| (i as u64) << 32 | b);
        if holders.contains(&a) {
            cluster.board().set_prefixes(a, 16, own.chain(chain.iter().copied()));
        } else {
            cluster.board().set_prefixes(a, 16, own);
        }
    }
    let mut matched = Vec::with_capacity(OPS);
    for i in 0..OPS + WARMUP {
        if i % 250 == 0 {
            refresh();
        }
        let t = Clock::now();
        let route = cluster.route_for(&prompt, 42).map_err(|e| e.to_string())?;
        let took = t.elapsed();
        assert!(holders.contains(&&route.decode), "routed to {} holding nothing of the prompt", route.decode);
        if i >= WARMUP {
            matched.push(took);
        }
    }
    let (b50, b99) = report("baseline", base);
    let (d50, d99) = report("decision", decide);
    let (m50, m99) = report("prefix", matched);
    println!("decision / baseline: p50 {:.1}x, p99 {:.1}x ({WORKERS} workers)", d50 / b50, d99 / b99);
    println!("prefix decision / baseline: p50 {:.1}x, p99 {:.1}x", m50 / b50, m99 / b99);
    Ok(())
}
