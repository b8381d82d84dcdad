//! The abuse table on real processes: one coordinator with a tenants file
//! in front of one prefill and one decode worker, one part per row.
//!
//! - `max_tokens` above the tenant's cap: 400 `max_tokens_too_large`
//!   naming the field and the cap.
//! - Too many streams: a tenant with one stream open gets 429
//!   `too_many_streams` (Retry-After) for a second, and a stream again once
//!   the first ends.
//! - A request rate over the budget: 429 `rate_limit_requests` with the
//!   Retry-After the bucket's refill gives.
//! - Slow headers and a slow body: the connection is closed within the
//!   timeout (the body with 408 `request_timeout`).
//! - An unknown key, and a key revoked by a reload on SIGHUP: 401; a bad
//!   file on SIGHUP is refused and the old one stays.
//! - A flood of 1 MiB prompts from one tenant: another tenant's requests
//!   still answer promptly (compared with the same requests alone, in this
//!   test, with generous bounds).
//! - The KV share: a tenant whose open stream holds most of its
//!   `max_kv_share` of the decode worker's pool gets 429 `kv_share` (with
//!   Retry-After) for a request that would pass it, and is served once the
//!   stream ends.
//! - Priority end to end: a tenant's class (and a client's `x-priority`
//!   within what the tenant allows) reaches both workers, counted by the
//!   class each received.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use facts::metrics::coordinator::{TENANTS_RELOADS, TENANT_KV_TOKENS, TENANT_REQUESTS, TOKENIZER_QUEUE};
use facts::metrics::worker::REQUESTS_BY_PRIORITY;
use serde_json::{json, Value};

const HEADER_TIMEOUT_MS: u64 = 1000;
const BODY_TIMEOUT_MS: u64 = 1000;

const TENANTS: &str = r#"
[tenants.capped]
keys = ["sk-capped"]
max_tokens = 64
max_streams = 1

[tenants.slow]
keys = ["sk-slow"]
requests_per_s = 2

[tenants.quiet]
keys = ["sk-quiet", "sk-quiet-old"]

[tenants.flood]
keys = ["sk-flood"]

[tenants.urgent]
keys = ["sk-urgent"]
priority = "high"

[tenants.batch]
keys = ["sk-batch"]
priority = "low"

[tenants.kvcap]
keys = ["sk-kvcap"]
max_kv_share = 0.05
"#;

fn completion(max_tokens: u32) -> Value {
    json!({"model": MODEL, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0})
}

fn post_as(h: &str, key: &str, path: &str, body: &Value) -> opskit::Result<(u16, HeaderMap, String)> {
    let auth = format!("Bearer {key}");
    http(h, "POST", path, "application/json", body.to_string().as_bytes(), &[("Authorization", &auth)])
}

fn code_of(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// What every part needs of the cluster.
struct Cx {
    h: String,
    pid: u32,
    file: std::path::PathBuf,
    /// The workers' metrics addresses: decode, prefill.
    worker_metrics: [String; 2],
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_abuse_table() -> TestResult {
    let dir = std::env::temp_dir().join(format!("tandem-tenants-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("tenants.toml");
    std::fs::write(&file, TENANTS)?;
    let path = file.to_str().ok_or("temp path")?.to_owned();
    let (ht, bt) = (HEADER_TIMEOUT_MS.to_string(), BODY_TIMEOUT_MS.to_string());
    let Pair { prefill, decode, coord } = start_pair(
        "512",
        &[
            "--tenants",
            &path,
            "--http-header-timeout-ms",
            &ht,
            "--http-body-timeout-ms",
            &bt,
            // Room for the 1 MiB prompts of the flood.
            "--max-body-bytes",
            "4194304",
        ],
    )?;
    let h = coord.addr("http")?;
    eventually("the coordinator reporting ready", || http(&h, "GET", "/ready", "", b"", &[]).is_ok_and(|r| r.0 == 200))
        .await?;
    let worker_metrics = [decode.addr("metrics")?.to_string(), prefill.addr("metrics")?.to_string()];
    let cx = Arc::new(Cx { h, pid: coord.pid, file, worker_metrics });

    let mut failed = Vec::new();
    record(&mut failed, "max_tokens cap", tokio::spawn(max_tokens_cap(cx.clone())).await);
    record(&mut failed, "too many streams", tokio::spawn(too_many_streams(cx.clone())).await);
    record(&mut failed, "request rate", tokio::spawn(request_rate(cx.clone())).await);
    record(
        &mut failed,
        "slow headers",
        tokio::task::spawn_blocking({
            let cx = cx.clone();
            move || slow_headers(&cx)
        })
        .await,
    );
    record(
        &mut failed,
        "slow body",
        tokio::task::spawn_blocking({
            let cx = cx.clone();
            move || slow_body(&cx)
        })
        .await,
    );
    record(&mut failed, "unknown and revoked keys", tokio::spawn(keys_and_reload(cx.clone())).await);
    record(&mut failed, "1 MiB prompt flood", tokio::spawn(flood(cx.clone())).await);
    record(&mut failed, "kv share", tokio::spawn(kv_share(cx.clone())).await);
    record(&mut failed, "priority reaches the workers", tokio::spawn(priority_reaches_the_workers(cx.clone())).await);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(failed.is_empty(), "{} part(s) failed:\n{}", failed.len(), failed.join("\n"));
    Ok(())
}

/// 400 naming `max_tokens` and the cap, before anything runs; at the cap it runs.
async fn max_tokens_cap(cx: Arc<Cx>) -> TestResult {
    let (s, _, b) = post_as(&cx.h, "sk-capped", "/v1/completions", &completion(65))?;
    error_of(s, &b, 400, Some("max_tokens"))?;
    assert_eq!(code_of(&b), "max_tokens_too_large", "{b}");
    assert!(b.contains("64") && b.contains("65"), "the cap and the ask are named: {b}");
    let mut chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 100});
    let (s, _, b) = post_as(&cx.h, "sk-capped", "/v1/chat/completions", &chat)?;
    error_of(s, &b, 400, Some("max_completion_tokens"))?;
    chat["max_completion_tokens"] = json!(2);
    let (s, _, b) = post_as(&cx.h, "sk-capped", "/v1/chat/completions", &chat)?;
    assert_eq!(s, 200, "{b}");
    let refused = metric(&cx.h, TENANT_REQUESTS, &[("tenant", "capped"), ("outcome", "max_tokens_too_large")])?;
    assert_eq!(refused, 2.0);
    Ok(())
}

/// A streamed completion of `max_tokens` (no early end) as `key`, open once its head arrived.
async fn open_long_stream(h: &str, key: &str, max_tokens: u32) -> opskit::Result<EventStream> {
    let mut long = completion(max_tokens);
    long["stream"] = json!(true);
    long["ignore_eos"] = json!(true);
    let (h, auth) = (h.to_owned(), format!("Bearer {key}"));
    tokio::task::spawn_blocking(move || open_stream(&h, "/v1/completions", &long, &[("Authorization", &auth)]))
        .await
        .map_err(|e| opskit::Error::Process(format!("stream task: {e}")))?
}

/// `body` (with `headers`) is a 429 of `code` with a Retry-After of 1 to 60 s.
fn refused_429(status: u16, headers: &HeaderMap, body: &str, code: &str) -> TestResult {
    error_of(status, body, 429, None)?;
    assert_eq!(code_of(body), code, "{body}");
    let retry = headers.get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    assert!(retry.is_some_and(|s| (1..=60).contains(&s)), "Retry-After: {retry:?}");
    Ok(())
}

/// One stream open: a second is 429 `too_many_streams` with Retry-After, a
/// non-streamed request still runs, and a stream opens again once the first ends.
async fn too_many_streams(cx: Arc<Cx>) -> TestResult {
    let h = cx.h.clone();
    let first = open_long_stream(&h, "sk-capped", 64).await?;
    let mut second = completion(64);
    second["stream"] = json!(true);
    let (s, headers, b) = post_as(&h, "sk-capped", "/v1/completions", &second)?;
    refused_429(s, &headers, &b, "too_many_streams")?;
    let (s, _, b) = post_as(&h, "sk-capped", "/v1/completions", &completion(2))?;
    assert_eq!(s, 200, "an answer that is not streamed is not a stream: {b}");
    let events = tokio::task::spawn_blocking(move || first.rest()).await??;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    // The first stream's place comes back as its answer ends (a moment after [DONE]).
    let mut short = completion(2);
    short["stream"] = json!(true);
    eventually("a stream place again", || {
        post_as(&h, "sk-capped", "/v1/completions", &short).is_ok_and(|r| r.0 == 200 && r.2.contains("[DONE]"))
    })
    .await?;
    Ok(())
}

/// `kvcap` may hold 5% of the decode worker's 512 blocks of 16: 409 tokens.
/// An open stream holding 320 (5 prompt tokens and 300 to generate, in whole
/// blocks) leaves no room for 112 more; once it ends there is.
async fn kv_share(cx: Arc<Cx>) -> TestResult {
    let h = cx.h.clone();
    let first = open_long_stream(&h, "sk-kvcap", 300).await?;
    let (s, headers, b) = post_as(&h, "sk-kvcap", "/v1/completions", &completion(96))?;
    refused_429(s, &headers, &b, "kv_share")?;
    // The stream's hold is what the coordinator shows: 5 + 300 tokens in 20 blocks.
    let page = opskit::prom::scrape_blocking(&h)?;
    assert_eq!(page.get(TENANT_KV_TOKENS, &[("tenant", "kvcap")])?, 320.0);
    // Under the share a request passes beside it.
    let (s, _, b) = post_as(&h, "sk-kvcap", "/v1/completions", &completion(8))?;
    assert_eq!(s, 200, "6 + 8 tokens (one block) fit beside the stream: {b}");
    // The client goes away: the stream's hold ends with its request.
    drop(first);
    eventually("the stream's KV share comes back", || {
        post_as(&h, "sk-kvcap", "/v1/completions", &completion(96)).is_ok_and(|r| r.0 == 200)
    })
    .await?;
    let page = opskit::prom::scrape_blocking(&h)?;
    assert!(page.get(TENANT_REQUESTS, &[("tenant", "kvcap"), ("outcome", "kv_share")])? >= 1.0);
    // Nothing of kvcap's runs now: nothing held.
    eventually("kvcap's hold back to 0", || {
        opskit::prom::scrape_blocking(&h)
            .is_ok_and(|p| p.get(TENANT_KV_TOKENS, &[("tenant", "kvcap")]).is_ok_and(|v| v == 0.0))
    })
    .await?;
    Ok(())
}

/// Two requests per second: the burst passes, the next is 429
/// `rate_limit_requests` with a Retry-After from the refill (1 s).
async fn request_rate(cx: Arc<Cx>) -> TestResult {
    let tokenize = json!({"prompt": "hello"});
    let mut codes = Vec::new();
    for _ in 0..4 {
        let (s, headers, b) = post_as(&cx.h, "sk-slow", "/tokenize", &tokenize)?;
        let retry = headers.get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
        codes.push((s, code_of(&b), retry));
    }
    assert_eq!(codes[0].0, 200, "{codes:?}");
    let refused: Vec<_> = codes.iter().filter(|c| c.0 == 429).collect();
    assert!(!refused.is_empty(), "four at once over two per second: {codes:?}");
    for (_, code, retry) in refused {
        assert_eq!(code, "rate_limit_requests");
        assert_eq!(retry.as_deref(), Some("1"), "half a second's refill, rounded up");
    }
    // Another tenant is not touched.
    assert_eq!(post_as(&cx.h, "sk-quiet", "/tokenize", &tokenize)?.0, 200);
    Ok(())
}

/// Reads until the peer closes; the bytes read and how long it took.
fn read_to_close(s: &mut TcpStream, limit: Duration) -> Result<(Vec<u8>, Duration), String> {
    let started = Instant::now();
    s.set_read_timeout(Some(limit)).map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return Ok((got, started.elapsed())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            // A reset is a close too.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok((got, started.elapsed())),
            Err(e) => return Err(format!("the connection stayed open for {:?}: {e}", started.elapsed())),
        }
    }
}

/// A head that never ends: closed within the header timeout (plus slack for a loaded machine).
fn slow_headers(cx: &Cx) -> TestResult {
    let mut s = TcpStream::connect(&cx.h)?;
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-quiet\r\n")?;
    let (_, took) = read_to_close(&mut s, Duration::from_secs(30))?;
    let bound = Duration::from_millis(HEADER_TIMEOUT_MS) + Duration::from_secs(4);
    assert!(took <= bound, "closed after {took:?}, bound {bound:?}");
    // The server is fine for everyone else.
    assert_eq!(http(&cx.h, "GET", "/health", "", b"", &[])?.0, 200);
    Ok(())
}

/// A body that stops short: 408 `request_timeout`, then the connection closes.
fn slow_body(cx: &Cx) -> TestResult {
    let mut s = TcpStream::connect(&cx.h)?;
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-quiet\r\n\
                Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":";
    s.write_all(head.as_bytes())?;
    let (got, took) = read_to_close(&mut s, Duration::from_secs(30))?;
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("request_timeout"), "{text}");
    let bound = Duration::from_millis(BODY_TIMEOUT_MS) + Duration::from_secs(4);
    assert!(took <= bound, "closed after {took:?}, bound {bound:?}");
    Ok(())
}

fn sighup(pid: u32) -> TestResult {
    let ok = std::process::Command::new("kill").args(["-HUP", &pid.to_string()]).status()?.success();
    assert!(ok, "kill -HUP {pid}");
    Ok(())
}

/// An unknown key is 401; a key the reloaded file drops is 401 from the
/// reload on, while the tenant's other key works; a bad file is refused and
/// changes nothing.
async fn keys_and_reload(cx: Arc<Cx>) -> TestResult {
    let tokenize = json!({"prompt": "hello"});
    let (s, _, b) = post_as(&cx.h, "sk-nobody", "/tokenize", &tokenize)?;
    error_of(s, &b, 401, None)?;
    assert_eq!(code_of(&b), "invalid_api_key");
    assert_eq!(post_as(&cx.h, "sk-quiet-old", "/tokenize", &tokenize)?.0, 200);

    let applied = counter_before(&cx.h, TENANTS_RELOADS, &[("outcome", "applied")])?;
    std::fs::write(&cx.file, TENANTS.replace(", \"sk-quiet-old\"", ""))?;
    sighup(cx.pid)?;
    eventually("the reload applied", || {
        metric(&cx.h, TENANTS_RELOADS, &[("outcome", "applied")]).is_ok_and(|n| n > applied)
    })
    .await?;
    let (s, _, b) = post_as(&cx.h, "sk-quiet-old", "/tokenize", &tokenize)?;
    error_of(s, &b, 401, None)?;
    assert_eq!(post_as(&cx.h, "sk-quiet", "/tokenize", &tokenize)?.0, 200, "the tenant's other key stays");

    let refused = counter_before(&cx.h, TENANTS_RELOADS, &[("outcome", "refused")])?;
    std::fs::write(&cx.file, "[tenants.quiet]\nkeys = [\"sk-quiet\"]\nmax_streams = 0\n")?;
    sighup(cx.pid)?;
    eventually("the bad file refused", || {
        metric(&cx.h, TENANTS_RELOADS, &[("outcome", "refused")]).is_ok_and(|n| n > refused)
    })
    .await?;
    assert_eq!(post_as(&cx.h, "sk-capped", "/tokenize", &tokenize)?.0, 200, "the old file is still in force");
    // Put the good file back for the parts after this one.
    std::fs::write(&cx.file, TENANTS)?;
    sighup(cx.pid)?;
    eventually("the old key back", || post_as(&cx.h, "sk-quiet-old", "/tokenize", &tokenize).is_ok_and(|r| r.0 == 200))
        .await?;
    Ok(())
}

/// Median seconds of `n` short completions by tenant `quiet`.
fn quiet_latency(h: &str, n: usize) -> Result<f64, String> {
    let mut took = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        let (s, _, b) = post_as(h, "sk-quiet", "/v1/completions", &completion(2)).map_err(|e| e.to_string())?;
        if s != 200 {
            return Err(format!("quiet's request got {s}: {b}"));
        }
        took.push(t.elapsed().as_secs_f64());
    }
    took.sort_by(f64::total_cmp);
    Ok(took[n / 2])
}

/// Tenant `flood` keeps four 1 MiB prompts in flight; tenant `quiet`'s short
/// requests are timed alone and then during the flood.
async fn flood(cx: Arc<Cx>) -> TestResult {
    let h = cx.h.clone();
    let alone = {
        let h = h.clone();
        tokio::task::spawn_blocking(move || quiet_latency(&h, 5)).await??
    };
    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(AtomicUsize::new(0));
    let mut senders = Vec::new();
    let prompt = "lorem ipsum dolor sit amet ".repeat((1 << 20) / 27);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}).to_string();
    for _ in 0..4 {
        let (h, stop, answered, body) = (h.clone(), stop.clone(), answered.clone(), body.clone());
        senders.push(std::thread::spawn(move || {
            let mut codes = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let r = http(
                    &h,
                    "POST",
                    "/v1/completions",
                    "application/json",
                    body.as_bytes(),
                    &[("Authorization", "Bearer sk-flood")],
                );
                if let Ok((s, _, b)) = r {
                    codes.push((s, code_of(&b)));
                    answered.fetch_add(1, Ordering::Relaxed);
                }
            }
            codes
        }));
    }
    // The flood is on: its first prompts were tokenized (and refused: far over the context).
    let a = answered.clone();
    eventually("the flood's first answers", move || a.load(Ordering::Relaxed) >= 2).await?;
    let during = {
        let h = h.clone();
        tokio::task::spawn_blocking(move || quiet_latency(&h, 5)).await?
    };
    // Still on when quiet's last answer came: flood prompts in the tokenizer pool.
    let busy = metric(&h, TOKENIZER_QUEUE, &[]);
    stop.store(true, Ordering::Relaxed);
    let mut codes = Vec::new();
    for s in senders {
        codes.extend(s.join().map_err(|_| "a flood thread panicked")?);
    }
    let during = during?;
    let busy = busy?;
    assert!(busy >= 1.0, "the flood was in the tokenizer pool while quiet was timed ({busy} jobs)");
    assert!(
        codes
            .iter()
            .all(|(s, c)| matches!((*s, c.as_str()), (400, "context_length_exceeded") | (503, "tokenizer_busy"))),
        "every 1 MiB prompt is refused as too long, or shed by the pool: {codes:?}"
    );
    let bound = alone * 5.0 + 2.0;
    assert!(during <= bound, "quiet's median {during:.3} s during the flood, {alone:.3} s alone (bound {bound:.3} s)");
    Ok(())
}

/// Each request's class arrives at the decode worker (`Generate`) and the
/// prefill worker (`Prefill`; the prompt is past the local-prefill limit): the
/// tenant's own class, or a lower one the client asks for with
/// `x-priority`. Only this part sends high or low requests.
async fn priority_reaches_the_workers(cx: Arc<Cx>) -> TestResult {
    let count = |class: &str| -> opskit::Result<[f64; 2]> {
        let [d, p] = &cx.worker_metrics;
        Ok([
            metric(d, REQUESTS_BY_PRIORITY, &[("priority", class)])?,
            metric(p, REQUESTS_BY_PRIORITY, &[("priority", class)])?,
        ])
    };
    // Past the coordinator's local-prefill limit (32 tokens), so the
    // prefill worker is asked too.
    let long = json!({"model": MODEL, "prompt": "Tell me about the history of Paris. ".repeat(6), "max_tokens": 2});
    let before = [count("high")?, count("normal")?, count("low")?];
    for key in ["sk-urgent", "sk-batch", "sk-batch"] {
        let (s, _, b) = post_as(&cx.h, key, "/v1/completions", &long)?;
        assert_eq!(s, 200, "{key}: {b}");
    }
    // The high tenant asks for less than its class: allowed.
    let body = long.to_string();
    let (s, _, b) = http(
        &cx.h,
        "POST",
        "/v1/completions",
        "application/json",
        body.as_bytes(),
        &[("Authorization", "Bearer sk-urgent"), ("x-priority", "low")],
    )?;
    assert_eq!(s, 200, "{b}");
    let after = [count("high")?, count("normal")?, count("low")?];
    let sent = |i: usize| [after[i][0] - before[i][0], after[i][1] - before[i][1]];
    assert_eq!(sent(0), [1.0, 1.0], "high requests at (decode, prefill)");
    assert_eq!(sent(2), [3.0, 3.0], "low requests at (decode, prefill)");
    assert_eq!(sent(1), [0.0, 0.0], "nothing arrived as normal");
    Ok(())
}
