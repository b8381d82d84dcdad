//! The overload contract on real processes: API keys, the central queue
//! (429 for a caller over its share, 503 when the queue is full, 504 for a
//! deadline that passes in the queue, all with the OpenAI error body and
//! Retry-After where a retry helps), priority classes, a burst at three
//! times capacity, and Idempotency-Key retries that run once.
//!
//! One coordinator with one running slot and a queue of four, in front of
//! one prefill and one decode worker. A long streaming request holds the
//! slot while the queue is filled, so every refusal is decided while the
//! slot is provably busy, and nothing depends on timing.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;

use std::sync::{mpsc, Arc};

use common::*;
use facts::metrics::coordinator::{QUEUE_DEPTH, SHED};
use facts::metrics::decode::DECODE_REQUESTS;
use facts::metrics::prefill::PREFILL_REQUESTS;
use facts::metrics::worker::KV_BLOCKS_USED;
use serde_json::{json, Value};

/// (status, headers, body) or why there was no answer.
type Reply = Result<(u16, HeaderMap, String), String>;

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

fn completion(max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0})
}

/// [`completion`], each a new request (see `common::unique`): these parts send new
/// requests after refusals, not retries.
fn fresh(max_tokens: u32) -> Value {
    let mut v = completion(max_tokens);
    v["user"] = Value::from(unique());
    v
}

fn post_as(h: &str, key: &str, body: &Value, extra: &[(&str, &str)]) -> Reply {
    let auth = bearer(key);
    let mut headers = vec![("Authorization", auth.as_str())];
    headers.extend_from_slice(extra);
    http(h, "POST", "/v1/completions", "application/json", body.to_string().as_bytes(), &headers)
        .map_err(|e| e.to_string())
}

/// Posts on a thread; the answer arrives on the returned channel.
fn spawn_post(h: &str, key: &str, body: Value, extra: Vec<(String, String)>) -> mpsc::Receiver<Reply> {
    let (tx, rx) = mpsc::channel();
    let (h, key) = (h.to_owned(), key.to_owned());
    std::thread::spawn(move || {
        let extra: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let _ = tx.send(post_as(&h, &key, &body, &extra));
    });
    rx
}

fn answer(rx: &mpsc::Receiver<Reply>) -> Reply {
    rx.recv_timeout(WAIT).map_err(|_| format!("no answer within {WAIT:?}"))?
}

fn code_of(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn rss_kib(pid: u32) -> Result<u64, String> {
    opskit::process::status_kib(pid, "VmRSS").ok_or_else(|| format!("no VmRSS for pid {pid}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_contract_keys_priorities_and_idempotency() -> TestResult {
    let dir = std::env::temp_dir().join(format!("tandem-admission-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let keys = dir.join("keys");
    std::fs::write(&keys, "# test keys\nsk-alice alice\nsk-bob bob\nsk-carol carol\n")?;
    let keys = keys.to_str().ok_or("temp path")?.to_owned();

    let Pair { prefill, decode, coord } = start_pair(
        "512",
        &["--api-keys-file", &keys, "--max-running", "1", "--max-queued", "4", "--per-key-max-queued", "2"],
    )?;
    let h = coord.addr("http")?;
    eventually("the coordinator reporting ready", || http(&h, "GET", "/ready", "", b"", &[]).is_ok_and(|r| r.0 == 200))
        .await?;

    let cx = Arc::new(Cx {
        h: h.clone(),
        decode_metrics: decode.addr("metrics")?,
        prefill_metrics: prefill.addr("metrics")?,
        coord_pid: coord.pid,
    });

    // Each part runs in a task of its own, one after another on this cluster (they
    // share its one running seat): a failed assertion fails its part and the later
    // parts still run, so one failure does not hide the others.
    let mut failed = Vec::new();
    record(&mut failed, "keys", tokio::spawn(api_keys(cx.clone())).await);
    record(&mut failed, "idempotency", tokio::spawn(idempotency(cx.clone())).await);
    record(&mut failed, "idempotent streaming", tokio::spawn(idempotent_streaming(cx.clone())).await);
    record(&mut failed, "queue contract", tokio::spawn(queue_contract(cx.clone())).await);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failed.is_empty(), "{} part(s) failed:\n{}", failed.len(), failed.join("\n"));
    Ok(())
}

/// What every part needs of the cluster.
struct Cx {
    h: String,
    decode_metrics: String,
    prefill_metrics: String,
    coord_pid: u32,
}

/// Keys: health, ready and metrics are open; everything else needs one.
async fn api_keys(cx: Arc<Cx>) -> TestResult {
    let h = cx.h.clone();
    // Keys: health, ready and metrics are open; everything else needs one.
    let (s, _, b) = post(&h, "/v1/completions", &completion(2))?;
    error_of(s, &b, 401, None)?;
    assert_eq!(code_of(&b), "invalid_api_key");
    let (s, _, b) = post_as(&h, "sk-mallory", &completion(2), &[])?;
    error_of(s, &b, 401, None)?;
    assert!(!b.contains("sk-mallory"), "a key is never echoed: {b}");
    assert_eq!(http(&h, "GET", "/v1/models", "", b"", &[])?.0, 401);
    assert_eq!(http(&h, "GET", "/v1/models", "", b"", &[("Authorization", &bearer("sk-bob"))])?.0, 200);
    for open in ["/health", "/ready", "/metrics"] {
        assert_eq!(http(&h, "GET", open, "", b"", &[])?.0, 200, "{open}");
    }
    let (s, _, b) = post_as(&h, "sk-alice", &completion(2), &[("x-priority", "urgent")])?;
    error_of(s, &b, 400, Some("x-priority"))?;

    Ok(())
}

/// Two identical requests with one Idempotency-Key run once; a later retry gets
/// the kept answer; the key with another body is refused; keys are per caller.
async fn idempotency(cx: Arc<Cx>) -> TestResult {
    let h = cx.h.clone();
    let m = cx.decode_metrics.clone();
    // Generate streams the decode worker ended, whatever the outcome.
    let served = |m: &str| metric_sum(m, DECODE_REQUESTS, &[]);
    // Idempotency: two identical requests with one key run once; a later
    // retry gets the kept answer; the key with another body is refused.
    // None yet (the requests above were refused at admission): it appears with the first;
    // the reads below need it.
    let before = counter_before(&m, DECODE_REQUESTS, &[])?;
    let key = vec![("Idempotency-Key".to_owned(), "order-42".to_owned())];
    let first = spawn_post(&h, "sk-alice", completion(8), key.clone());
    let second = spawn_post(&h, "sk-alice", completion(8), key.clone());
    let (a, b) = (answer(&first)?, answer(&second)?);
    assert_eq!((a.0, b.0), (200, 200), "{} / {}", a.2, b.2);
    let (va, vb) = (json_of(&a.2)?, json_of(&b.2)?);
    assert_eq!(va["id"], vb["id"], "the retry attached to the first request");
    assert_eq!(va["choices"], vb["choices"]);
    eventually("the decode worker ending the one run", || served(&m).is_ok_and(|n| n >= before + 1.0)).await?;
    let (s, _, later) = post_as(&h, "sk-alice", &completion(8), &[("Idempotency-Key", "order-42")])?;
    assert_eq!((s, json_of(&later)?["id"].clone()), (200, va["id"].clone()), "replayed after it finished");
    assert_eq!(served(&m)?, before + 1.0, "three requests with one key ran once");
    let (s, _, b) = post_as(&h, "sk-alice", &completion(9), &[("Idempotency-Key", "order-42")])?;
    error_of(s, &b, 422, None)?;
    assert_eq!(code_of(&b), "idempotency_key_reused");
    // Keys are per caller: bob's "order-42" is his own request.
    let (s, _, b) = post_as(&h, "sk-bob", &completion(8), &[("Idempotency-Key", "order-42")])?;
    assert_eq!(s, 200, "{b}");
    assert_ne!(json_of(&b)?["id"], va["id"]);

    Ok(())
}

/// Streaming with a key: the retry replays the same events, [DONE] included.
async fn idempotent_streaming(cx: Arc<Cx>) -> TestResult {
    let h = cx.h.clone();
    let m = cx.decode_metrics.clone();
    // Generate streams the decode worker ended, whatever the outcome.
    let served = |m: &str| metric_sum(m, DECODE_REQUESTS, &[]);
    // Streaming with a key: the retry replays the same events, [DONE] included.
    let mut streaming = completion(6);
    streaming["stream"] = json!(true);
    let auth = bearer("sk-carol");
    let run = |b: &Value| -> opskit::Result<Vec<String>> {
        open_stream(&h, "/v1/completions", b, &[("Authorization", &auth), ("Idempotency-Key", "s-1")])?.rest()
    };
    let before = served(&m)?;
    let e1 = run(&streaming)?;
    eventually("the decode worker ending the streamed run", || served(&m).is_ok_and(|n| n >= before + 1.0)).await?;
    let e2 = run(&streaming)?;
    assert_eq!(e1.last().map(String::as_str), Some("[DONE]"), "{e1:?}");
    assert_eq!(e1, e2, "the retry replays the recorded events");
    assert_eq!(served(&m)?, before + 1.0, "two streaming requests with one key ran once");
    // Each answer ended at max_tokens: the coordinator read the worker's own end
    // before hanging up, so none counts as a client cancel.
    // The family is exported (`served` read it); `cancelled` appears with its first cancel.
    let cancelled = counter_before(&m, DECODE_REQUESTS, &[("outcome", "cancelled")])?;
    assert_eq!(cancelled, 0.0, "answers that ran to max_tokens were counted cancelled on the decode worker");

    Ok(())
}

/// One long stream holds the seat: queue deadlines, per-key shares, a burst at
/// three times capacity, priority then fairness, and the metrics of it all.
async fn queue_contract(cx: Arc<Cx>) -> TestResult {
    let h = cx.h.clone();
    let m = cx.decode_metrics.clone();
    // The slot is taken by a long stream (alice) for the rest of the test.
    let long = json!({
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0,
        "ignore_eos": true, "stream": true,
    });
    let mut holder = open_stream(&h, "/v1/completions", &long, &[("Authorization", &bearer("sk-alice"))])?;
    assert_eq!(holder.status, 200);
    holder.next_event()?.ok_or("the long stream ended at once")?;
    let depth = |n: f64| {
        let h = h.clone();
        move || metric(&h, QUEUE_DEPTH, &[]).is_ok_and(|v| v == n)
    };

    // A deadline that passes in the queue: 504, dropped before prefill.
    let pm = cx.prefill_metrics.clone();
    // Short prompts are prefilled on the decode worker here, so this counter may not exist
    // yet (it is rendered from its first increment): read as 0 until it does.
    let prefills = || counter_before(&pm, PREFILL_REQUESTS, &[("outcome", "ok")]);
    let prefilled = prefills()?;
    let short_deadline = vec![("x-request-timeout-ms".to_owned(), "1000".to_owned())];
    let (s, hd, b) = answer(&spawn_post(&h, "sk-carol", fresh(4), short_deadline))?;
    error_of(s, &b, 504, None)?;
    assert!(b.contains("queued") && !hd.contains_key("retry-after"), "{b}");
    // The same with an absolute deadline (Unix ms) one second ahead.
    let unix_ms = |ahead_ms: i64| -> Result<String, String> {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_err(|e| e.to_string())?;
        Ok((now.as_millis() as i64 + ahead_ms).to_string())
    };
    let absolute = vec![("x-request-deadline".to_owned(), unix_ms(1000)?)];
    let (s, _, b) = answer(&spawn_post(&h, "sk-carol", fresh(4), absolute))?;
    error_of(s, &b, 504, None)?;
    assert!(b.contains("queued"), "{b}");
    // One already past is refused at arrival, before the queue.
    let past = vec![("x-request-deadline".to_owned(), unix_ms(-1000)?)];
    let (s, _, b) = answer(&spawn_post(&h, "sk-carol", fresh(4), past))?;
    error_of(s, &b, 504, None)?;
    assert!(!b.contains("queued") && code_of(&b) == "deadline_exceeded", "{b}");
    assert_eq!(prefills()?, prefilled, "a request dropped in the queue never reached prefill");

    // Alice fills her share of the queue (2, normal); the third is hers to wait for: 429.
    let alice: Vec<_> = (0..2).map(|_| spawn_post(&h, "sk-alice", fresh(3), Vec::new())).collect();
    eventually("alice's two requests queued", depth(2.0)).await?;
    let (s, hd, b) = post_as(&h, "sk-alice", &fresh(3), &[])?;
    error_of(s, &b, 429, None)?;
    assert_eq!(code_of(&b), "rate_limit_exceeded");
    let retry_after = hd.get("retry-after").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    assert!(retry_after.is_some_and(|r| (1..=60).contains(&r)), "{hd:?}");

    // Bob queues one normal and one high: the queue is full (4).
    let bob_normal = spawn_post(&h, "sk-bob", fresh(3), Vec::new());
    eventually("bob's normal request queued", depth(3.0)).await?;
    let bob_high = spawn_post(&h, "sk-bob", fresh(3), vec![("x-priority".to_owned(), "high".to_owned())]);
    eventually("bob's high request queued", depth(4.0)).await?;

    // A burst at three times the capacity (1 running + 4 queued) from a
    // caller with nothing queued: every one is refused at once with
    // 503 queue_full + Retry-After while the slot is still busy; nothing
    // hangs and the coordinator's memory stays flat.
    let rss_before = rss_kib(cx.coord_pid)?;
    let burst: Vec<_> = (0..15).map(|_| spawn_post(&h, "sk-carol", fresh(3), Vec::new())).collect();
    for rx in &burst {
        let (s, hd, b) = answer(rx)?;
        error_of(s, &b, 503, None)?;
        assert_eq!(code_of(&b), "queue_full");
        assert!(hd.contains_key("retry-after"), "{hd:?}");
    }
    assert_eq!(holder.next_event()?.map(|e| e.contains("\"text\"")), Some(true), "the slot was busy throughout");
    let rss_after = rss_kib(cx.coord_pid)?;
    assert!(rss_after < rss_before + 32 * 1024, "RSS grew from {rss_before} to {rss_after} KiB");

    // The long stream goes away; the queue drains in priority order, then
    // fairness: bob's high request is served before everything queued earlier.
    drop(holder);
    let mut waits = vec![("bob-high", bob_high), ("bob-normal", bob_normal)];
    waits.extend(alice.into_iter().map(|rx| ("alice", rx)));
    let mut ids = Vec::new();
    for (who, rx) in &waits {
        let (s, _, b) = answer(rx)?;
        assert_eq!(s, 200, "{who}: {b}");
        // The request id carries the coordinator's dispatch sequence number.
        let id = json_of(&b)?["id"].as_str().map(str::to_owned).ok_or("no id")?;
        let seq: u64 = id.rsplit('-').next().and_then(|n| n.parse().ok()).ok_or("id without a sequence")?;
        ids.push((seq, *who));
    }
    ids.sort();
    assert_eq!(ids[0].1, "bob-high", "the high-priority request was dispatched first: {ids:?}");
    // Inside the normal class, bob (one request) is not behind both of alice's.
    let normal: Vec<&str> = ids[1..].iter().map(|(_, w)| *w).collect();
    assert_ne!(normal, ["alice", "alice", "bob-normal"], "bob waited behind alice's whole backlog: {ids:?}");

    // The contract shows up in the coordinator's metrics.
    let shed = |r: &str| metric(&h, SHED, &[("reason", r)]);
    assert_eq!(shed("queue_full")?, 15.0);
    assert_eq!(shed("key_limit")?, 1.0);
    assert_eq!(shed("queue_deadline")?, 2.0, "the relative and the absolute deadline that passed in the queue");
    eventually("the decode worker's KV back to 0", || metric(&m, KV_BLOCKS_USED, &[]).is_ok_and(|v| v == 0.0)).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_refuses_the_queue_at_once_and_drains_the_running() -> TestResult {
    let Pair { prefill: _p, decode: _d, coord } =
        start_pair("512", &["--max-running", "1", "--max-queued", "8", "--shutdown-timeout-ms", "60000"])?;
    let mut coord = coord;
    let h = coord.addr("http")?;
    eventually("the coordinator reporting ready", || http(&h, "GET", "/ready", "", b"", &[]).is_ok_and(|r| r.0 == 200))
        .await?;
    let long = json!({
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "temperature": 0,
        "ignore_eos": true, "stream": true,
    });
    let mut holder = open_stream(&h, "/v1/completions", &long, &[])?;
    assert_eq!(holder.status, 200);
    holder.next_event()?.ok_or("the long stream ended at once")?;
    let queued: Vec<_> = (0..3).map(|_| spawn_post(&h, "none", fresh(3), Vec::new())).collect();
    eventually("three requests queued", || metric(&h, QUEUE_DEPTH, &[]).is_ok_and(|v| v == 3.0)).await?;

    coord.signal(Signal::Term)?;
    let signalled = std::time::Instant::now();
    for rx in &queued {
        let (s, hd, b) = rx.recv_timeout(WAIT).map_err(|_| "a queued request got no answer")??;
        error_of(s, &b, 503, None)?;
        assert_eq!(code_of(&b), "shutting_down", "{b}");
        let retry_after = hd.get("retry-after").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
        assert!(retry_after.is_some_and(|r| r >= 1), "{hd:?}");
    }
    let took = signalled.elapsed();
    assert!(took < std::time::Duration::from_secs(1), "the queued requests were answered after {took:?}");
    // A request arriving during the drain hears why too; the probe says not ready.
    let (s, hd, b) = post(&h, "/v1/completions", &fresh(3))?;
    error_of(s, &b, 503, None)?;
    assert_eq!(code_of(&b), "shutting_down", "{b}");
    assert!(hd.contains_key("retry-after"), "{hd:?}");
    assert_eq!(http(&h, "GET", "/ready", "", b"", &[])?.0, 503, "draining: not ready");

    // The running request was not cut: it ends with [DONE] after every token.
    let rest = holder.rest()?;
    assert_eq!(rest.last().map(String::as_str), Some("[DONE]"), "the in-flight stream was cut: {:?}", rest.last());
    let texts = rest.iter().filter(|e| e.contains("\"text\"")).count();
    assert!(texts >= 390, "only {texts} token events after the first");
    let mut exit = None;
    eventually("the coordinator exiting after the drain", || {
        exit = coord.exited();
        exit.is_some()
    })
    .await?;
    let status = exit.ok_or("no exit status")?;
    assert_eq!(status.code(), Some(0), "exit status after a clean drain");
    Ok(())
}
