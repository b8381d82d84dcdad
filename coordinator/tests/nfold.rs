//! The N-fold check: three coordinators on one etcd in front of two decode
//! workers of 3 seats each (cluster capacity C = 6) dispatch no more than
//! C requests at once in all, not 3C. Each follows the cluster's capacity
//! split by the live coordinators (`max(1, floor(C / 3))` = 2 each, waited
//! for on `tandem_coordinator_admission_capacity`). During a burst of 30
//! requests spread over the three, the decode workers' own counters
//! (`Generate`s received minus ended) are sampled every 20 ms: their sum
//! never passes C, and reaches at least C - 1, so the burst did fill the
//! cluster (without the split each coordinator dispatches up to 6).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use facts::metrics::coordinator::{ADMISSION_CAPACITY, FLEET_SPLIT};
use facts::metrics::decode::DECODE_REQUESTS;
use facts::metrics::worker::REQUESTS_BY_PRIORITY;
use serde_json::json;

const SEATS: u32 = 3;
const CAPACITY: u32 = 2 * SEATS;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_coordinators_never_dispatch_more_than_the_cluster_runs() -> TestResult {
    let etcd = opskit::etcd::Etcd::start().await?;
    let ep = etcd.endpoint();
    let prefix = format!("nfold-{}", std::process::id());
    let seats = SEATS.to_string();
    let worker = |id: &'static str| -> Vec<String> {
        ["--etcd", &ep, "--cluster-prefix", &prefix, "--threads", "1", "--version-group", "g1", "--worker-id", id]
            .iter()
            .map(|s| (*s).to_owned())
            .chain(["--kv-blocks", "256", "--max-running", &seats].iter().map(|s| (*s).to_owned()))
            .collect()
    };
    let pargs = worker("p1");
    let _p1 = start("tandem-prefill-worker", &pargs.iter().map(String::as_str).collect::<Vec<_>>(), &["grpc"])?;
    let mut decode = Vec::new();
    for id in ["d1", "d2"] {
        let mut a = worker(id);
        a.extend(["--kv-load-failure-policy", "recompute"].map(str::to_owned));
        decode.push(start("tandem-decode-worker", &a.iter().map(String::as_str).collect::<Vec<_>>(), &["grpc"])?);
    }
    let mut coords = Vec::new();
    for id in ["c1", "c2", "c3"] {
        coords.push(start_etcd_coordinator(&ep, &prefix, &["--coordinator-id", id, "--fleet-lease-ttl-s", "2"])?);
    }
    let hs: Vec<String> = coords.iter().map(|c| c.addr("http").map(|a| a.to_string())).collect::<Result<_, _>>()?;
    for h in &hs {
        eventually("a coordinator ready, splitting by 3, its share 2", || {
            http(h, "GET", "/ready", "", b"", &[]).is_ok_and(|r| r.0 == 200)
                && metric(h, FLEET_SPLIT, &[]).is_ok_and(|n| n == 3.0)
                && metric(h, ADMISSION_CAPACITY, &[]).is_ok_and(|n| n == f64::from(CAPACITY / 3))
        })
        .await?;
    }

    // The sampler: the decode workers' requests in hand, from their own
    // counters (received `Generate`s minus ended ones; a worker counts the
    // end before it sends it), every 20 ms until the burst ends. Every
    // worker's received count is read before any worker's ended count, so
    // a sample can only undercount what was in hand at the moment between
    // (a request ending on one worker while its successor starts on the
    // other is not counted twice).
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU32::new(0));
    let pages: Vec<String> =
        decode.iter().map(|d| d.addr("metrics").map(|a| a.to_string())).collect::<Result<_, _>>()?;
    let sampler = {
        let (done, peak) = (done.clone(), peak.clone());
        tokio::task::spawn_blocking(move || -> opskit::Result<()> {
            while !done.load(Ordering::SeqCst) {
                let mut received = 0.0;
                for m in &pages {
                    received += metric(m, REQUESTS_BY_PRIORITY, &[("priority", "normal")])?;
                }
                let mut ended = 0.0;
                for m in &pages {
                    ended += metric_sum(m, DECODE_REQUESTS, &[])?;
                }
                peak.fetch_max((received - ended).max(0.0) as u32, Ordering::SeqCst);
                std::thread::park_timeout(Duration::from_millis(20));
            }
            Ok(())
        })
    };
    let body = json!({"model": MODEL, "prompt": "Once upon a time, in a quiet village by the sea, there lived",
                      "max_tokens": 24, "temperature": 0, "ignore_eos": true});
    let mut burst = Vec::new();
    for i in 0..30 {
        let (h, body) = (hs[i % 3].clone(), body.clone());
        burst.push(tokio::task::spawn_blocking(move || post(&h, "/v1/completions", &body).map(|r| (r.0, r.2))));
    }
    let mut statuses = Vec::new();
    for b in burst {
        let (s, text) = b.await??;
        statuses.push((s, if s == 200 { String::new() } else { text }));
    }
    done.store(true, Ordering::SeqCst);
    sampler.await??;
    let peak = peak.load(Ordering::SeqCst);
    eprintln!("peak {peak} requests in hand at the workers; capacity {CAPACITY}");
    assert!(statuses.iter().all(|(s, _)| *s == 200), "every request of the burst is served: {statuses:?}");
    assert!(peak <= CAPACITY, "the workers held {peak} requests at once; the cluster runs {CAPACITY}");
    assert!(peak >= CAPACITY - 1, "the burst never filled the cluster (peak {peak}): the check saw nothing");
    Ok(())
}
