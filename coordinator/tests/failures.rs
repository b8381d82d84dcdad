//! Failures at the coordinator, on real processes and a real etcd: a decode
//! worker killed mid-stream, etcd restarted and then down past the lease TTL
//! (no worker fences, served until the stale bound, then 503) and past
//! `--registry-max-stale-ms`, and a client that goes away mid-stream.
//! Each test proves its fault happened (process gone, etcd unreachable past
//! the bound, tokens cut short) and ends with every worker's KV back to zero.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use facts::metrics::decode::{DECODE_REQUESTS, GENERATION_TOKENS, RESERVATIONS_ACTIVE};
use facts::metrics::worker::{KV_BLOCKS_USED, REQUESTS_RUNNING};
use serde_json::{json, Value};

fn long_stream(max_tokens: u32) -> Value {
    json!({
        "model": MODEL, "prompt": "Once upon a time, in a quiet village by the sea,",
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true, "stream": true,
    })
}

/// The text of one streamed completions event.
fn text_of(event: &str) -> Result<String, String> {
    let v: Value = serde_json::from_str(event).map_err(|e| format!("{e}: {event}"))?;
    v["choices"][0]["text"].as_str().map(str::to_owned).ok_or_else(|| format!("no text in {event}"))
}

/// A short request, each a new one: its `user` differs from every other's, so the retry
/// gate does not take a request sent after a refusal for a retry of the refused one.
fn short() -> Value {
    json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "user": unique()})
}

/// Worker flags for a registered worker of group g1.
fn worker_args<'a>(ep: &'a str, prefix: &'a str, id: &'a str, ttl: &'a str) -> Vec<&'a str> {
    vec![
        "--etcd",
        ep,
        "--cluster-prefix",
        prefix,
        "--lease-ttl-s",
        ttl,
        "--threads",
        "1",
        "--version-group",
        "g1",
        "--worker-id",
        id,
        "--kv-blocks",
        "256",
    ]
}

fn decode_args<'a>(ep: &'a str, prefix: &'a str, id: &'a str, ttl: &'a str) -> Vec<&'a str> {
    let mut v = worker_args(ep, prefix, id, ttl);
    v.extend(["--kv-load-failure-policy", "recompute"]);
    v
}

/// Waits until the worker's KV pool (and a decode worker's reservations: a prefill worker
/// holds none) is back to zero; a missing series never is.
async fn settled(p: &Proc, what: &str) -> TestResult {
    let m = p.addr("metrics")?;
    let decode = p.name == "tandem-decode-worker";
    eventually(&format!("{what}: KV blocks back to 0"), || {
        metric(&m, KV_BLOCKS_USED, &[]).is_ok_and(|v| v == 0.0)
            && (!decode || metric(&m, RESERVATIONS_ACTIVE, &[]).is_ok_and(|v| v == 0.0))
    })
    .await
}

/// SIGKILL of a decode worker with a stream running on each of two: the killed
/// worker's stream moves to the other (request migration) and both complete with
/// the undisturbed answer's text; new requests are routed around the dead worker at
/// once, and once its lease runs out it leaves membership; no KV is left held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_killed_mid_stream_loses_no_stream() -> TestResult {
    let etcd = opskit::etcd::Etcd::start().await?;
    let ep = etcd.endpoint();
    let prefill = start("tandem-prefill-worker", &worker_args(&ep, "k9", "p1", "2"), &["grpc", "metrics"])?;
    let d1 = start("tandem-decode-worker", &decode_args(&ep, "k9", "d1", "2"), &["grpc", "metrics"])?;
    let d2 = start("tandem-decode-worker", &decode_args(&ep, "k9", "d2", "2"), &["grpc", "metrics"])?;
    let coord = start_etcd_coordinator(&ep, "k9", &[])?;
    let h = coord.addr("http")?;
    eventually("the coordinator is ready", || http(&h, "GET", "/ready", "", b"", &[]).is_ok_and(|r| r.0 == 200))
        .await?;
    let membership =
        registry::Membership::start(registry::MembershipConfig::new(registry::EtcdConfig::new(etcd.endpoints()), "k9"))
            .await?;
    eventually("both decode workers are registered", || {
        membership.view().workers().filter(|w| w.role == registry::Role::Decode).count() == 2
    })
    .await?;

    // Two long streams: the router spreads them, one per decode worker.
    let mut streams = Vec::new();
    for _ in 0..2 {
        let mut s = open_stream(&h, "/v1/completions", &long_stream(300), &[])?;
        assert_eq!(s.status, 200);
        let first = s.next_event()?.ok_or("the stream ended before its first token")?;
        assert!(first.contains("\"text\""), "{first}");
        streams.push((s, text_of(&first)?));
    }
    let (m1, m2) = (d1.addr("metrics")?, d2.addr("metrics")?);
    // The gauge is refreshed by the coordinator's load polls.
    eventually("one stream on each decode worker", || {
        [&m1, &m2].iter().all(|m| metric(m, REQUESTS_RUNNING, &[]).is_ok_and(|v| v == 1.0))
    })
    .await?;

    d1.signal(Signal::Kill)?;
    // Request migration: the killed worker's stream moves to d2 and goes on from its
    // last token; the client sees one stream, no error, no token twice or missing.
    let mut texts = Vec::new();
    for (s, mut text) in streams {
        let events = s.rest()?;
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "every stream completes: {events:?}");
        for e in &events[..events.len() - 1] {
            text.push_str(&text_of(e)?);
        }
        texts.push(text);
    }
    let mut whole = long_stream(300);
    whole["stream"] = json!(false);
    let (s, _, body) = post(&h, "/v1/completions", &whole)?;
    assert_eq!(s, 200, "{body}");
    let reference: Value = serde_json::from_str(&body)?;
    let reference = reference["choices"][0]["text"].as_str().ok_or("no text")?;
    for t in &texts {
        assert_eq!(t, reference, "a moved stream's text equals the undisturbed answer");
    }
    let moved = metric(&h, facts::metrics::coordinator::MIGRATIONS, &[("reason", "worker_lost"), ("outcome", "ok")])?;
    assert_eq!(moved, 1.0, "the killed worker's stream moved once");

    // New requests succeed on the remaining worker at once: a refused
    // connection is routed again, and the load poller marks d1 unreachable.
    for _ in 0..4 {
        let (s, _, body) = post(&h, "/v1/completions", &short())?;
        assert_eq!(s, 200, "{body}");
    }
    // Its lease (2 s) runs out and it leaves membership.
    eventually("d1 leaves membership", || !membership.view().contains(registry::Role::Decode, "d1")).await?;
    for _ in 0..2 {
        let (s, _, body) = post(&h, "/v1/completions", &short())?;
        assert_eq!(s, 200, "{body}");
    }
    settled(&d2, "decode d2").await?;
    settled(&prefill, "prefill").await?;
    membership.stop().await;
    drop(etcd);
    Ok(())
}

/// `facts::metrics::worker::FENCES` on a worker's `/metrics`; a page without the
/// series is an error, not 0 (a renamed counter must not pass as "never fenced").
fn fences(p: &Proc) -> opskit::Result<f64> {
    metric(&p.addr("metrics")?, facts::metrics::worker::FENCES, &[])
}

/// Static stability: etcd is the control plane, the data plane outlives it.
/// An etcd restart under load loses nothing; an etcd down past the workers'
/// lease TTL fences no worker and the coordinator keeps serving (and stays
/// ready) from its last membership, until `--registry-max-stale-ms`; past
/// that bound it refuses with 503 `registry_unavailable` + Retry-After and
/// `/ready` 503; etcd back, it serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_outage_serves_until_the_stale_bound_and_fences_no_worker() -> TestResult {
    // Lease TTL 2 s; the coordinator serves from a membership etcd last
    // confirmed up to 10 s ago. The test fails if a worker fences within
    // 5 s (2.5 TTLs) of etcd going down, or the coordinator refuses then.
    const TTL_S: &str = "2";
    const MAX_STALE: Duration = Duration::from_secs(10);
    const PAST_TTL: Duration = Duration::from_secs(5);
    let mut etcd = opskit::etcd::Etcd::start().await?;
    let ep = etcd.endpoint();
    let prefill = start("tandem-prefill-worker", &worker_args(&ep, "er", "p1", TTL_S), &["grpc", "metrics"])?;
    let decode = start("tandem-decode-worker", &decode_args(&ep, "er", "d1", TTL_S), &["grpc", "metrics"])?;
    let max_stale_ms = MAX_STALE.as_millis().to_string();
    let coord = start_etcd_coordinator(&ep, "er", &["--registry-max-stale-ms", &max_stale_ms])?;
    let h = coord.addr("http")?;
    eventually("the coordinator is ready", || http(&h, "GET", "/ready", "", b"", &[]).is_ok_and(|r| r.0 == 200))
        .await?;
    let (s, _, body) = post(&h, "/v1/completions", &short())?;
    assert_eq!(s, 200, "{body}");
    let workers = [("prefill", &prefill), ("decode", &decode)];
    for (name, w) in workers {
        assert_eq!(fences(w)?, 0.0, "{name} fenced before any fault");
    }

    // Load runs through an etcd restart: served from the cached membership,
    // every request completes.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (h, stop) = (h.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut statuses = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                statuses.push(post(&h, "/v1/completions", &short()).map(|r| (r.0, r.2)));
            }
            statuses
        })
    };
    let m = decode.addr("metrics")?;
    let served_before = metric_sum(&m, DECODE_REQUESTS, &[])?;
    etcd.restart().await?;
    eventually("requests complete after the restart", || {
        metric_sum(&m, DECODE_REQUESTS, &[]).is_ok_and(|v| v >= served_before + 3.0)
    })
    .await?;
    stop.store(true, Ordering::SeqCst);
    let statuses = load.join().map_err(|_| "the load thread panicked")?;
    assert!(statuses.len() >= 3, "{statuses:?}");
    assert!(statuses.iter().all(|s| s.as_ref().is_ok_and(|s| s.0 == 200)), "{statuses:?}");

    // etcd down past the lease TTL: no worker fences (an unreachable etcd
    // is no reason to), and the coordinator keeps routing from its last
    // membership, ready, every request 200.
    etcd.stop();
    let down = std::time::Instant::now();
    let mut served = 0;
    while down.elapsed() < PAST_TTL {
        let (s, _, body) = post(&h, "/v1/completions", &short())?;
        assert_eq!(s, 200, "{:?} into the etcd outage, within the stale bound: {body}", down.elapsed());
        let (s, _, body) = http(&h, "GET", "/ready", "", b"", &[])?;
        assert_eq!(s, 200, "{:?} into the etcd outage, within the stale bound: {body}", down.elapsed());
        served += 1;
    }
    assert!(served >= 3, "only {served} requests in {PAST_TTL:?}: the outage phase proved nothing");
    for (name, w) in workers {
        assert_eq!(fences(w)?, 0.0, "{name} fenced with etcd down {:?} (lease TTL {TTL_S} s)", down.elapsed());
    }

    // Past the stale bound: an explicit, retryable refusal, and not ready.
    eventually("503 registry_unavailable once the membership is older than the bound", || {
        post(&h, "/v1/completions", &short()).is_ok_and(|(s, _, _)| s == 503)
    })
    .await?;
    assert!(down.elapsed() >= MAX_STALE - Duration::from_secs(2), "refused {:?} into the outage", down.elapsed());
    for _ in 0..3 {
        let (s, hd, body) = post(&h, "/v1/completions", &short())?;
        error_of(s, &body, 503, None)?;
        assert_eq!(json_of(&body)?["error"]["code"], "registry_unavailable", "{body}");
        assert!(hd.contains_key("retry-after"), "{hd:?}");
    }
    let (s, _, body) = http(&h, "GET", "/ready", "", b"", &[])?;
    assert_eq!(s, 503, "ready past the stale bound: {body}");
    for (name, w) in workers {
        assert_eq!(fences(w)?, 0.0, "{name} fenced with etcd down {:?}", down.elapsed());
    }

    // etcd back: the coordinator re-lists and serves again; still no fence.
    etcd.restart().await?;
    eventually("serving again once etcd is back", || {
        post(&h, "/v1/completions", &short()).is_ok_and(|(s, _, _)| s == 200)
    })
    .await?;
    eventually("ready again once etcd is back", || http(&h, "GET", "/ready", "", b"", &[]).is_ok_and(|r| r.0 == 200))
        .await?;
    for (name, w) in workers {
        assert_eq!(fences(w)?, 0.0, "{name} fenced after etcd came back");
    }
    settled(&decode, "decode").await?;
    settled(&prefill, "prefill").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_cancels_and_frees_kv() -> TestResult {
    let Pair { prefill, decode, coord } = start_pair("256", &["--local-prefill-max-tokens", "0"])?;
    let h = coord.addr("http")?;
    let m = decode.addr("metrics")?;

    // Streaming: read a few tokens, then hang up.
    let mut s = open_stream(&h, "/v1/completions", &long_stream(4000), &[])?;
    assert_eq!(s.status, 200);
    for _ in 0..3 {
        s.next_event()?.ok_or("the stream ended early")?;
    }
    eventually("the stream runs", || metric(&m, REQUESTS_RUNNING, &[]).is_ok_and(|v| v == 1.0)).await?;
    drop(s);
    eventually("the decode worker ends the abandoned stream", || {
        metric(&m, REQUESTS_RUNNING, &[]).is_ok_and(|v| v == 0.0)
    })
    .await?;
    let generated = metric_sum(&m, GENERATION_TOKENS, &[])?;
    assert!(generated < 4000.0, "cancelled, not run to max_tokens: {generated} tokens");
    settled(&decode, "decode").await?;
    settled(&prefill, "prefill").await?;

    // Non-streaming: the client sends its request and leaves before the answer.
    let before = metric_sum(&m, GENERATION_TOKENS, &[])?;
    let mut body = long_stream(4000);
    body["stream"] = json!(false);
    let conn = opskit::http::Request::post(&h, "/v1/completions").json(&body).start();
    eventually("the non-streaming request runs", || metric(&m, REQUESTS_RUNNING, &[]).is_ok_and(|v| v == 1.0)).await?;
    drop(conn);
    eventually("the decode worker ends the abandoned request", || {
        metric(&m, REQUESTS_RUNNING, &[]).is_ok_and(|v| v == 0.0)
    })
    .await?;
    let generated = metric_sum(&m, GENERATION_TOKENS, &[])? - before;
    assert!(generated < 4000.0, "cancelled, not run to max_tokens: {generated} tokens");
    settled(&decode, "decode").await?;
    settled(&prefill, "prefill").await?;
    Ok(())
}

/// A frozen decode worker (SIGSTOP: its TCP stack still accepts, nothing
/// answers) is taken out of routing once its load polls go unanswered for 4
/// intervals, counted stale, and with every decode worker frozen a request
/// gets a typed 503 at once instead of hanging; after SIGCONT both serve again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_decode_workers_are_stale_and_refused_fast() -> TestResult {
    let args =
        ["--version-group", "g", "--threads", "1", "--kv-blocks", "256", "--kv-load-failure-policy", "recompute"];
    let d1 = start("tandem-decode-worker", &args, &["grpc", "metrics"])?;
    let d2 = start("tandem-decode-worker", &args, &["grpc", "metrics"])?;
    let decode = format!("{},{}", d1.addr("grpc")?, d2.addr("grpc")?);
    let coord = start(
        "tandem-coordinator",
        &["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--decode", &decode, "--load-poll-ms", "100"],
        &["http"],
    )?;
    let h = coord.addr("http")?;
    eventually("the coordinator reporting ready", || http(&h, "GET", "/ready", "", b"", &[]).is_ok_and(|r| r.0 == 200))
        .await?;
    let stale = |h: &str| metric(h, facts::metrics::coordinator::WORKERS_STALE, &[("role", "decode")]);
    assert_eq!(stale(&h)?, 0.0, "both workers answer their polls");
    // A request that reached a frozen worker would wait out this deadline (504).
    let timeout = [("x-request-timeout-ms", "10000")];
    let ask =
        |h: &str| http(h, "POST", "/v1/completions", "application/json", short().to_string().as_bytes(), &timeout);

    d1.signal(Signal::Stop)?;
    let stopped = std::time::Instant::now();
    eventually("the frozen decode worker counted stale", || stale(&h).is_ok_and(|v| v == 1.0)).await?;
    // 4 intervals of 100 ms after its last answer, plus a poll round and the scrape.
    assert!(stopped.elapsed() < std::time::Duration::from_secs(2), "stale only after {:?}", stopped.elapsed());
    let served = |p: &Proc| -> opskit::Result<f64> { metric_sum(&p.addr("metrics")?, DECODE_REQUESTS, &[]) };
    // None served yet: the counter appears with the first; the wait below reads it strictly.
    let before = counter_before(&d2.addr("metrics")?, DECODE_REQUESTS, &[])?;
    for i in 0..6 {
        let (s, _, b) = ask(&h)?;
        assert_eq!(s, 200, "request {i} with one worker frozen: {b}");
    }
    eventually("the live worker ending all six", || served(&d2).is_ok_and(|n| n >= before + 6.0)).await?;

    d2.signal(Signal::Stop)?;
    eventually("both decode workers counted stale", || stale(&h).is_ok_and(|v| v == 2.0)).await?;
    let asked = std::time::Instant::now();
    let (s, hd, b) = ask(&h)?;
    let took = asked.elapsed();
    error_of(s, &b, 503, None)?;
    assert_eq!(json_of(&b)?["error"]["code"], "no_worker", "{b}");
    let retry_after = hd.get("retry-after").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    assert!(retry_after.is_some_and(|r| r >= 1), "{hd:?}");
    assert!(took < std::time::Duration::from_secs(1), "the refusal took {took:?}");
    assert_eq!(http(&h, "GET", "/ready", "", b"", &[])?.0, 503, "no decode worker answers: not ready");

    d1.signal(Signal::Cont)?;
    d2.signal(Signal::Cont)?;
    eventually("both workers answering again", || stale(&h).is_ok_and(|v| v == 0.0)).await?;
    let (s, _, b) = ask(&h)?;
    assert_eq!(s, 200, "after SIGCONT: {b}");
    settled(&d1, "decode worker 1").await?;
    settled(&d2, "decode worker 2").await
}
