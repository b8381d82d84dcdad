//! A tenant's limits hold for the fleet, not per coordinator: two real
//! coordinators on one real etcd split tenant `a`'s 10 requests per second.
//! Offered about 8x that through both, the admitted rate summed over both
//! stays within 10% of the quota; with one killed, the survivor's share
//! grows to the whole budget once the dead one's lease expires (and not
//! before it is counted out).
//!
//! The requests are `/tokenize` calls: they pass the tenant's request
//! limits like a generation and need no worker.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use facts::metrics::coordinator::FLEET_SPLIT;
use serde_json::json;

const QUOTA: f64 = 10.0;
const LEASE_TTL_S: &str = "2";

const TENANTS: &str = r#"
[tenants.a]
keys = ["sk-a"]
requests_per_s = 10
"#;

fn coordinator(ep: &str, prefix: &str, tenants: &str, id: &str) -> opskit::Result<Proc> {
    let args = [
        "--http",
        "127.0.0.1:0",
        "--grpc",
        "127.0.0.1:0",
        "--etcd",
        ep,
        "--cluster-prefix",
        prefix,
        "--tenants",
        tenants,
        "--coordinator-id",
        id,
        "--fleet-lease-ttl-s",
        LEASE_TTL_S,
    ];
    start("tandem-coordinator", &args, &["http"])
}

/// One request as tenant `a`: admitted (200) or refused for its rate (429).
fn try_once(h: &str) -> Result<bool, String> {
    let body = json!({"prompt": "hi"}).to_string();
    let (s, headers, b) =
        http(h, "POST", "/tokenize", "application/json", body.as_bytes(), &[("Authorization", "Bearer sk-a")])
            .map_err(|e| e.to_string())?;
    match s {
        200 => Ok(true),
        429 if b.contains("rate_limit_requests") && headers.get("retry-after").is_some() => Ok(false),
        _ => Err(format!("{s}: {b}")),
    }
}

/// Empties `h`'s bucket for tenant `a` (until a refusal).
fn drain(h: &str) -> Result<(), String> {
    for _ in 0..1000 {
        if !try_once(h)? {
            return Ok(());
        }
    }
    Err("no refusal in 1,000 requests".into())
}

/// Offers `per_s` requests per second spread over `hosts` (round robin,
/// four senders) for `window`; returns the admitted count per host.
fn offer(hosts: &[String], per_s: f64, window: Duration) -> Result<Vec<usize>, String> {
    let senders = 4;
    let gap = Duration::from_secs_f64(senders as f64 / per_s);
    let stop = Arc::new(AtomicBool::new(false));
    let until = Instant::now() + window;
    let mut threads = Vec::new();
    for i in 0..senders {
        let (hosts, stop) = (hosts.to_vec(), stop.clone());
        threads.push(std::thread::spawn(move || -> Result<Vec<usize>, String> {
            let mut admitted = vec![0; hosts.len()];
            let mut k = i;
            // Pacing the offered load (not waiting for a condition).
            let mut next = Instant::now() + gap.mul_f64(i as f64 / senders as f64);
            while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                std::thread::sleep(next.saturating_duration_since(Instant::now()));
                next += gap;
                let host = k % hosts.len();
                k += 1;
                if try_once(&hosts[host])? {
                    admitted[host] += 1;
                }
            }
            Ok(admitted)
        }));
    }
    let mut total = vec![0; hosts.len()];
    for t in threads {
        let counts = t.join().map_err(|_| "a sender panicked".to_owned())??;
        total.iter_mut().zip(counts).for_each(|(t, c)| *t += c);
    }
    stop.store(true, Ordering::Relaxed);
    Ok(total)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_coordinators_admit_one_quota_and_a_survivor_takes_the_whole() -> TestResult {
    let etcd = opskit::etcd::Etcd::start().await?;
    let ep = etcd.endpoint();
    let dir = std::env::temp_dir().join(format!("tandem-fleet-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("tenants.toml");
    std::fs::write(&file, TENANTS)?;
    let tenants = file.to_str().ok_or("temp path")?.to_owned();
    let prefix = format!("fleet-{}", std::process::id());
    let one = coordinator(&ep, &prefix, &tenants, "c1")?;
    let mut two = coordinator(&ep, &prefix, &tenants, "c2")?;
    let hosts = vec![one.addr("http")?, two.addr("http")?];
    for h in &hosts {
        eventually("both coordinators counting two", || metric(h, FLEET_SPLIT, &[]).is_ok_and(|n| n == 2.0)).await?;
    }

    // Two coordinators: 5 per second each. Start from empty buckets, then offer ~8x.
    let window = Duration::from_secs(6);
    let counts = tokio::task::spawn_blocking({
        let hosts = hosts.clone();
        move || {
            hosts.iter().try_for_each(|h| drain(h))?;
            offer(&hosts, QUOTA * 8.0, window)
        }
    })
    .await??;
    let rate = counts.iter().sum::<usize>() as f64 / window.as_secs_f64();
    assert!((rate - QUOTA).abs() <= QUOTA * 0.1, "admitted {rate:.1}/s over both ({counts:?}), quota {QUOTA}/s");
    assert!(counts.iter().all(|&c| c > 0), "both admitted their share: {counts:?}");

    // Kill one: the survivor counts it out once its lease expires, then takes the whole budget.
    two.kill9().await?;
    let survivor = hosts[0].clone();
    assert_eq!(metric(&survivor, FLEET_SPLIT, &[])?, 2.0, "a dead coordinator counts until its lease expires");
    eventually("the survivor counting one", || metric(&survivor, FLEET_SPLIT, &[]).is_ok_and(|n| n == 1.0)).await?;
    let window = Duration::from_secs(4);
    let counts = tokio::task::spawn_blocking(move || {
        drain(&survivor)?;
        offer(&[survivor], QUOTA * 5.0, window)
    })
    .await??;
    let rate = counts[0] as f64 / window.as_secs_f64();
    assert!((rate - QUOTA).abs() <= QUOTA * 0.1, "the survivor admitted {rate:.1}/s alone, quota {QUOTA}/s");
    drop(one);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
