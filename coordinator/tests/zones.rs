//! Zone pairing on real processes and a real etcd: workers register `--zone`, and a
//! coordinator with `--zone-pairing=require` sends every remote prefill to the decode
//! worker's own zone — the other zone's prefill worker is idle and as good by load, and
//! gets nothing; each route counts it skipped (`reason="zone"`), none crosses. A second
//! coordinator on the same membership with the default `any` does pair across zones,
//! and counts those routes in `tandem_coordinator_cross_zone_routes_total`.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use common::*;
use facts::metrics::coordinator::{CROSS_ZONE_ROUTES, PREFILL_ATTEMPTS, ROUTE_PAIRS_SKIPPED, WORKERS};
use serde_json::json;

/// Flags of a registered worker of group g1 in `zone`.
fn worker<'a>(ep: &'a str, id: &'a str, zone: &'a str) -> Vec<&'a str> {
    vec![
        "--etcd",
        ep,
        "--cluster-prefix",
        "zones",
        "--version-group",
        "g1",
        "--worker-id",
        id,
        "--zone",
        zone,
        "--threads",
        "1",
        "--kv-blocks",
        "128",
    ]
}

/// Sends a fresh short completion (a prompt no worker holds a prefix of, so it is
/// prefilled remotely); fails unless it is answered 200.
fn complete(http: &str) -> TestResult {
    let id = unique();
    let body =
        json!({"model": MODEL, "prompt": format!("{id}: the capital of France is"), "max_tokens": 2, "user": id});
    let (status, _, text) = post(http, "/v1/completions", &body)?;
    if status != 200 {
        return Err(format!("completion answered {status}: {text}").into());
    }
    Ok(())
}

async fn ready(http: &str) -> TestResult {
    eventually("the coordinator is ready with every worker registered", || {
        http_get_ok(http, "/ready")
            && metric(http, WORKERS, &[("role", "prefill"), ("state", "serving")]).is_ok_and(|n| n == 2.0)
    })
    .await
}

fn http_get_ok(addr: &str, path: &str) -> bool {
    http(addr, "GET", path, "", b"", &[]).is_ok_and(|r| r.0 == 200)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_zones_keep_kv_in_the_decode_workers_zone_and_any_crosses() -> TestResult {
    let etcd = opskit::etcd::Etcd::start().await?;
    let ep = etcd.endpoint();
    let _near = start("tandem-prefill-worker", &worker(&ep, "near", "zone-a"), &["grpc", "metrics"])?;
    let _far = start("tandem-prefill-worker", &worker(&ep, "far", "zone-b"), &["grpc", "metrics"])?;
    let mut dargs = worker(&ep, "d", "zone-a");
    dargs.extend(["--kv-load-failure-policy", "recompute"]);
    let _decode = start("tandem-decode-worker", &dargs, &["grpc", "metrics"])?;

    let strict = start_etcd_coordinator(&ep, "zones", &["--zone-pairing", "require"])?;
    let strict_http = strict.addr("http")?;
    ready(&strict_http).await?;
    const N: usize = 6;
    for _ in 0..N {
        complete(&strict_http)?;
    }
    let attempts = metric_sum(&strict_http, PREFILL_ATTEMPTS, &[("worker", "near")])?;
    assert_eq!(attempts, N as f64, "every remote prefill in the decode worker's zone");
    // The other zone's worker was never tried: no attempt series names it.
    let page = opskit::http::Request::get(&strict_http, "/metrics").send_blocking()?.text();
    let far: Vec<&str> =
        page.lines().filter(|l| l.starts_with(PREFILL_ATTEMPTS) && l.contains("worker=\"far\"")).collect();
    assert!(far.is_empty(), "prefill attempts in the other zone: {far:?}");
    assert_eq!(metric(&strict_http, ROUTE_PAIRS_SKIPPED, &[("reason", "zone")])?, N as f64, "one skipped per route");
    assert_eq!(metric(&strict_http, CROSS_ZONE_ROUTES, &[])?, 0.0);

    // The default ignores zones: power of two choices over two idle workers picks the
    // other zone's about half the time (all 20 in zone: 1 in a million).
    let loose = start_etcd_coordinator(&ep, "zones", &[])?;
    let loose_http = loose.addr("http")?;
    ready(&loose_http).await?;
    for _ in 0..20 {
        complete(&loose_http)?;
        if metric(&loose_http, CROSS_ZONE_ROUTES, &[])? > 0.0 {
            break;
        }
    }
    let crossed = metric(&loose_http, CROSS_ZONE_ROUTES, &[])?;
    assert!(crossed > 0.0, "`any` never paired across zones in 20 requests");
    let far = metric_sum(&loose_http, PREFILL_ATTEMPTS, &[("worker", "far")])?;
    assert_eq!(crossed, far, "each cross-zone route prefilled in the other zone");
    assert_eq!(metric(&loose_http, ROUTE_PAIRS_SKIPPED, &[("reason", "zone")])?, 0.0);
    Ok(())
}
