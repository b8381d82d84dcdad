//! The generator against a small in-process axum server that fakes an
//! OpenAI-compatible one. The prompt names what the fake does: stream an
//! answer (with usage when asked), refuse with 503 and an OpenAI error
//! body, fail mid-stream with an error event, send a data line that is not
//! JSON, stop without a finish reason, or hang. Each must come back as its
//! typed outcome with the right token counts.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::ListenerExt;
use axum::{Json, Router};
use loadgen::{Arrival, Endpoint, Hooks, Outcome, Plan, PromptSource, Record, Report};
use serde_json::{json, Value};
use tokio::sync::mpsc;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// The `busy-twice-NAME` prompts' attempts: the Idempotency-Key each carried.
static BUSY_TWICE: std::sync::Mutex<std::collections::BTreeMap<String, Vec<Option<String>>>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Tokens a streamed answer has: `max_tokens`, each one word.
fn word(i: u64) -> String {
    format!(" w{i}")
}

/// The `resume-whole` prompt's attempts: the Idempotency-Key each carried.
static WHOLE: std::sync::Mutex<Vec<Option<String>>> = std::sync::Mutex::new(Vec::new());

/// The `resume` prompt's attempts: the Idempotency-Key and Last-Event-ID each carried.
static RESUMES: std::sync::Mutex<Vec<(Option<String>, Option<String>)>> = std::sync::Mutex::new(Vec::new());

/// The `resume` prompt's attempts: the `x-request-timeout-ms` each carried.
static RESUME_DEADLINES: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());

/// A stream of five tokens, each event with an `id:` (the token count), cut three times:
/// the first attempt's connection breaks after two tokens, the second (from cursor 2) ends
/// with a `coordinator_draining` error event after one more, the third (from cursor 3) is
/// refused 503 `idempotent_original_failed`, the fourth (from 3 again) sends the rest.
fn resumable(headers: &HeaderMap) -> Response {
    let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).map(str::to_owned);
    let from = h("last-event-id");
    RESUMES.lock().unwrap_or_else(|e| e.into_inner()).push((h("idempotency-key"), from.clone()));
    let left = h("x-request-timeout-ms").and_then(|v| v.parse().ok()).unwrap_or(u64::MAX);
    RESUME_DEADLINES.lock().unwrap_or_else(|e| e.into_inner()).push(left);
    let event = |i: u64| format!("id: {}\ndata: {}\n\n", i + 1, json!({"choices": [{"text": word(i)}]}));
    let mut parts: Vec<Result<Bytes, std::io::Error>> = Vec::new();
    match from.as_deref() {
        None => {
            parts.extend((0..2).map(|i| Ok(Bytes::from(event(i)))));
            parts.push(Err(std::io::Error::other("the coordinator died")));
        }
        Some("2") => {
            parts.push(Ok(Bytes::from(event(2))));
            let e = json!({"error": {"message": "draining", "type": "overloaded_error", "code": "coordinator_draining",
                                     "cursor": "3", "seed": 1}});
            parts.push(Ok(Bytes::from(format!("data: {e}\n\n"))));
        }
        Some("3")
            if RESUMES
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .filter(|(_, c)| c.as_deref() == Some("3"))
                .count()
                == 1 =>
        {
            // The first resume from 3 meets its first attempt ending: refused, to be sent again.
            let e = json!({"error": {"message": "ended", "type": "overloaded_error", "code": "idempotent_original_failed"}});
            return (StatusCode::SERVICE_UNAVAILABLE, Json(e)).into_response();
        }
        Some("3") => {
            parts.extend((3..5).map(|i| Ok(Bytes::from(event(i)))));
            let end = json!({"choices": [{"text": "", "finish_reason": "length"}]});
            parts.push(Ok(Bytes::from(format!("id: 5.1\ndata: {end}\n\ndata: [DONE]\n\n"))));
        }
        Some(other) => {
            let e = json!({"error": {"message": format!("no cursor {other}"), "type": "invalid_request_error",
                                     "code": "resume_mismatch"}});
            return (StatusCode::CONFLICT, Json(e)).into_response();
        }
    }
    Response::builder()
        .header("content-type", "text/event-stream")
        // Each part a moment after the last, so the head and events are out before a cut.
        .body(Body::from_stream(futures_util::StreamExt::then(futures_util::stream::iter(parts), |p| async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            p
        })))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn completions(headers: HeaderMap, Json(req): Json<Value>) -> Response {
    let chat = req.get("messages").is_some();
    let prompt = if chat { &req["messages"][0]["content"] } else { &req["prompt"] };
    let prompt = prompt.as_str().unwrap_or_default().to_owned();
    let n = req["max_tokens"].as_u64().unwrap_or(16);
    let usage = req["stream_options"]["include_usage"].as_bool().unwrap_or(false);
    if prompt == "resume" {
        return resumable(&headers);
    }
    if prompt == "resume-whole" {
        // Three attempts: a body cut short, a 503 `shutting_down`, the answer.
        let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let n = {
            let mut seen = WHOLE.lock().unwrap_or_else(|e| e.into_inner());
            seen.push(key);
            seen.len()
        };
        return match n {
            1 => Response::builder()
                .header("content-type", "application/json")
                .body(Body::from_stream(futures_util::stream::iter([
                    Ok(Bytes::from_static(b"{\"choices\": [")),
                    Err(std::io::Error::other("the coordinator died")),
                ])))
                .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()),
            2 => {
                let e = json!({"error": {"message": "bye", "type": "overloaded_error", "code": "shutting_down"}});
                (StatusCode::SERVICE_UNAVAILABLE, Json(e)).into_response()
            }
            _ => Json(json!({"choices": [{"text": "whole", "finish_reason": "stop"}]})).into_response(),
        };
    }
    if prompt == "busy" {
        let body =
            json!({"error": {"message": "busy", "type": "overloaded_error", "param": null, "code": "overloaded"}});
        return (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "1")], Json(body)).into_response();
    }
    if let Some(name) = prompt.strip_prefix("busy-twice-") {
        // Refused twice (503, Retry-After: 1), then answered; what each attempt carried is kept.
        let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let n = {
            let mut seen = BUSY_TWICE.lock().unwrap_or_else(|e| e.into_inner());
            let attempts = seen.entry(name.to_owned()).or_default();
            attempts.push(key);
            attempts.len()
        };
        if n <= 2 {
            let body =
                json!({"error": {"message": "busy", "type": "overloaded_error", "param": null, "code": "queue_full"}});
            return (StatusCode::SERVICE_UNAVAILABLE, [("retry-after", "1")], Json(body)).into_response();
        }
        return Json(json!({"choices": [{"text": "ok", "finish_reason": "stop"}]})).into_response();
    }
    if prompt == "headers" {
        // Echo what the plan's optional headers became.
        let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).unwrap_or("-").to_owned();
        let text = format!("{} {} {}", h("x-request-timeout-ms"), h("x-priority"), h("authorization"));
        return Json(json!({"choices": [{"text": text, "finish_reason": "stop"}]})).into_response();
    }
    if req["stream"] != json!(true) {
        let text: String = (0..n).map(word).collect();
        return Json(json!({
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3},
        }))
        .into_response();
    }
    let (tx, rx) = mpsc::channel::<Bytes>(4);
    tokio::spawn(async move {
        let send = |s: String| {
            let tx = tx.clone();
            async move { tx.send(Bytes::from(s)).await.is_ok() }
        };
        let event = |text: &str, finish: Option<&str>| {
            let c = if chat {
                json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]})
            } else {
                json!({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})
            };
            format!("data: {c}\n\n")
        };
        let tokens = match prompt.as_str() {
            "fail-mid" | "garbage" | "cut" | "hang" => 2,
            _ => n,
        };
        for i in 0..tokens {
            // Each event in two writes, split inside the line.
            let e = event(&word(i), None);
            let (a, b) = e.split_at(e.len() / 2);
            if !send(a.to_owned()).await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            if !send(b.to_owned()).await {
                return;
            }
        }
        let tail = match prompt.as_str() {
            "fail-mid" => {
                let e = json!({"error": {"message": "deadline passed", "type": "timeout_error", "code": "deadline_exceeded"}});
                format!("data: {e}\n\n")
            }
            "garbage" => "data: {not json\n\n".to_owned(),
            "cut" => String::new(),
            "hang" => {
                // Hold the stream open until the client gives up.
                tx.closed().await;
                return;
            }
            _ => {
                // Finish, usage and [DONE] in one write.
                let mut t = event("", Some("length"));
                if usage {
                    let u = json!({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": tokens}});
                    t.push_str(&format!("data: {u}\n\n"));
                }
                t.push_str("data: [DONE]\n\n");
                t
            }
        };
        send(tail).await;
    });
    let stream =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx)) });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Starts the fake server; its base URL.
async fn fake_server() -> Result<String, std::io::Error> {
    Ok(counted_server().await?.0)
}

/// Starts the fake server; its base URL and a count of accepted connections.
async fn counted_server() -> Result<(String, Arc<AtomicUsize>), std::io::Error> {
    let app =
        Router::new().route("/v1/completions", post(completions)).route("/v1/chat/completions", post(completions));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    // Without TCP_NODELAY, Nagle holds each small write until the client's
    // delayed ACK (~40 ms) and the events arrive in bursts.
    let listener = listener.tap_io(move |tcp| {
        let _ = tcp.set_nodelay(true);
        count.fetch_add(1, Ordering::Relaxed);
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((format!("http://{addr}"), accepted))
}

fn plan(url: &str, prompts: &[&str]) -> Plan {
    let mut p = Plan::new(url, "fake");
    p.prompts = PromptSource::List(prompts.iter().map(|s| s.to_string()).collect());
    p.requests = prompts.len();
    p.max_tokens = 5;
    p.timeout = Duration::from_secs(10);
    p
}

fn outcomes(r: &Report) -> Vec<String> {
    r.records.iter().map(|r| r.outcome.label()).collect()
}

fn check_complete(r: &Record, tokens: u32, usage: bool) {
    assert_eq!(r.outcome, Outcome::Complete { finish_reason: "length".into() }, "{r:?}");
    assert_eq!((r.output_tokens, r.usage_reported), (tokens, usage), "{r:?}");
    let text: String = (0..u64::from(tokens)).map(word).collect();
    assert_eq!(r.text, text);
    assert_eq!(r.itl.len(), tokens as usize - 1);
    // The last token cannot arrive before the server slept 2 ms per token
    // (gaps themselves shrink when a busy client reads late, in bursts).
    let last = r.ttft.unwrap_or_default() + r.itl.iter().sum::<Duration>();
    assert!(last >= Duration::from_millis(2 * u64::from(tokens - 1)), "{r:?}");
    assert!(r.ttft.is_some() && r.e2e >= last, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_answers_refusals_and_broken_streams_get_their_outcomes() -> TestResult {
    let (url, accepted) = counted_server().await?;
    let mut p = plan(&url, &["ok", "busy", "ok", "fail-mid", "garbage", "cut", "busy", "ok"]);
    p.arrival = Arrival::Closed { concurrency: 3 };
    let report = loadgen::run(&p).await?;
    assert_eq!(
        outcomes(&report),
        ["complete", "http 503 overloaded", "complete", "stream_error deadline_exceeded", "protocol", "protocol"]
            .into_iter()
            .chain(["http 503 overloaded", "complete"])
            .collect::<Vec<_>>()
    );
    for i in [0, 2, 7] {
        check_complete(&report.records[i], 5, true);
    }
    let busy = &report.records[1];
    assert_eq!(
        busy.outcome,
        Outcome::HttpError { status: 503, code: Some("overloaded".into()), message: "busy".into() }
    );
    assert_eq!((busy.output_tokens, busy.ttft), (0, None));
    let mid = &report.records[3];
    assert_eq!((mid.output_tokens, mid.usage_reported, mid.text.as_str()), (2, false, " w0 w1"));
    assert!(matches!(&report.records[4].outcome, Outcome::Protocol(m) if m.contains("not JSON")));
    assert!(matches!(&report.records[5].outcome, Outcome::Protocol(m) if m.contains("finish_reason")));

    let s = report.summary();
    assert_eq!((s.requests, s.ok, s.errors), (8, 3, 5));
    assert_eq!(s.output_tokens, 3 * 5 + 2 + 2 + 2);
    assert_eq!((s.ttft.count, s.itl.count, s.e2e.count), (3, 12, 3));
    assert_eq!(s.mean_prompt_tokens, Some(3.0));
    assert!(s.output_tok_per_s > 0.0);
    assert!(report.records.windows(2).all(|w| w[0].index + 1 == w[1].index));
    // No keep-alive reuse: a server closing an idle connection cannot fail a request.
    assert_eq!(accepted.load(Ordering::Relaxed), 8, "one connection per request");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_usage_tokens_are_counted_from_content_events() -> TestResult {
    let url = fake_server().await?;
    let mut p = plan(&url, &["ok", "ok"]);
    p.include_usage = false;
    p.max_tokens = 7;
    for r in loadgen::run(&p).await?.records {
        check_complete(&r, 7, false);
    }
    p.endpoint = Endpoint::Chat;
    for r in loadgen::run(&p).await?.records {
        check_complete(&r, 7, false);
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_answers_take_tokens_from_usage() -> TestResult {
    let url = fake_server().await?;
    let mut p = plan(&url, &["ok", "busy"]);
    p.stream = false;
    let r = loadgen::run(&p).await?;
    assert_eq!(outcomes(&r), ["complete", "http 503 overloaded"]);
    let ok = &r.records[0];
    assert_eq!((ok.output_tokens, ok.usage_reported, ok.ttft), (5, true, None));
    assert_eq!(ok.text, " w0 w1 w2 w3 w4");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_stream_times_out_and_a_closed_port_is_a_transport_error() -> TestResult {
    let url = fake_server().await?;
    let mut p = plan(&url, &["hang"]);
    p.timeout = Duration::from_millis(300);
    let r = loadgen::run(&p).await?;
    let rec = &r.records[0];
    assert_eq!(rec.outcome, Outcome::Timeout);
    assert_eq!(rec.output_tokens, 2, "the tokens before the hang are kept");
    assert!(rec.e2e >= Duration::from_millis(300) && rec.e2e < Duration::from_secs(5), "{rec:?}");

    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let r = loadgen::run(&plan(&format!("http://{closed}"), &["ok"])).await?;
    assert!(matches!(&r.records[0].outcome, Outcome::Transport(m) if !m.is_empty()), "{:?}", r.records[0]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisson_arrivals_follow_the_seeded_schedule_and_headers_are_sent() -> TestResult {
    let url = fake_server().await?;
    let mut p = plan(&url, &["ok"]);
    p.requests = 6;
    p.arrival = Arrival::Poisson { rate: 50.0 };
    p.seed = 11;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let r = loadgen::run_with(&p, Hooks { records: Some(tx), ..Hooks::default() }).await?;
    let planned = loadgen::arrival::poisson_offsets(6, 50.0, 11);
    for (rec, at) in r.records.iter().zip(&planned) {
        check_complete(rec, 5, true);
        assert!(rec.start >= *at && rec.start < *at + Duration::from_millis(500), "{:?} vs {at:?}", rec.start);
    }
    let mut seen = 0;
    while rx.try_recv().is_ok() {
        seen += 1;
    }
    assert_eq!(seen, 6, "every record is also sent as it ends");

    let mut p = plan(&url, &["headers"]);
    p.stream = false;
    p.deadline = Some(Duration::from_millis(2500));
    p.priority = Some("low".into());
    p.api_key = Some("sk-test".into());
    let r = loadgen::run(&p).await?;
    assert_eq!(r.records[0].text, "2500 low Bearer sk-test");

    let hooks = Hooks::default();
    hooks.cancel.cancel();
    assert!(loadgen::run_with(&plan(&url, &["ok"]), hooks).await?.records.is_empty());
    Ok(())
}

/// A caller's origin is the clock records count from: a drill that timed a fault before
/// the run's task was scheduled reads each request's window on that same clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_count_from_the_callers_origin_when_given() -> TestResult {
    let url = fake_server().await?;
    let earlier = tokio::time::Instant::now() - Duration::from_secs(3);
    let r = loadgen::run_with(&plan(&url, &["ok"]), Hooks { origin: Some(earlier), ..Hooks::default() }).await?;
    let rec = &r.records[0];
    check_complete(rec, 5, true);
    assert!(rec.start >= Duration::from_secs(3) && rec.start < Duration::from_secs(8), "{rec:?}");
    assert!(r.wall >= Duration::from_secs(3), "{:?}", r.wall);
    let r = loadgen::run(&plan(&url, &["ok"])).await?;
    assert!(r.records[0].start < Duration::from_secs(3), "{:?}", r.records[0]);
    Ok(())
}

/// Every request body the conversation server saw, in arrival order.
type Seen = Arc<std::sync::Mutex<Vec<Value>>>;

/// Answers a chat with `a<N>` (N = messages received), whole, with usage
/// saying the whole prompt but the last message was cached.
async fn conversation(axum::extract::State(seen): axum::extract::State<Seen>, Json(req): Json<Value>) -> Response {
    let n = req["messages"].as_array().map_or(0, Vec::len);
    seen.lock().unwrap_or_else(|e| e.into_inner()).push(req);
    Json(json!({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("a{n}")}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10 * n, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 10 * n - 10}},
    }))
    .into_response()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chats_carry_their_history_and_share_system_prompts() -> TestResult {
    let seen: Seen = Arc::default();
    let app = Router::new().route("/v1/chat/completions", post(conversation)).with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });

    let mut p = Plan::new(&url, "fake");
    p.endpoint = Endpoint::Chat;
    p.stream = false;
    p.requests = 8;
    p.arrival = Arrival::Closed { concurrency: 2 };
    p.prompts = PromptSource::Chats { system_prompts: 2, system_tokens: 30, turns: 3, user_tokens: 12 };
    let r = loadgen::run(&p).await?;
    // 8 requests in conversations of 3: 3 + 3 + 2 turns.
    assert_eq!(r.records.iter().map(|r| r.outcome.label()).collect::<Vec<_>>(), vec!["complete"; 8]);
    let texts: Vec<&str> = r.records.iter().map(|r| r.text.as_str()).collect();
    assert_eq!(texts, ["a2", "a4", "a6", "a2", "a4", "a6", "a2", "a4"], "turn t sends 2t + 2 messages");

    let bodies = seen.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert_eq!(bodies.len(), 8);
    let content = |b: &Value, i: usize| b["messages"][i]["content"].as_str().unwrap_or_default().to_owned();
    let roles = |b: &Value| -> Vec<String> {
        b["messages"].as_array().into_iter().flatten().filter_map(|m| m["role"].as_str()).map(str::to_owned).collect()
    };
    // Each conversation's turns arrive in order, each extending the last
    // with the answer it got and a new user message.
    let mut systems = Vec::new();
    for b in &bodies {
        let rs = roles(b);
        assert_eq!(rs[0], "system");
        assert!(rs[1..].chunks(2).all(|c| c[0] == "user" && c.get(1).is_none_or(|r| r == "assistant")), "{rs:?}");
        for (k, i) in (2..rs.len()).step_by(2).enumerate() {
            assert_eq!(content(b, i), format!("a{}", 2 * k + 2), "the answer to turn {k} is in the history");
        }
        systems.push(content(b, 0));
    }
    let distinct: std::collections::HashSet<&String> = systems.iter().collect();
    assert_eq!(distinct.len(), 2, "conversations 0 and 2 share system prompt 0, conversation 1 has prompt 1");
    let users: std::collections::HashSet<String> =
        bodies.iter().map(|b| content(b, b["messages"].as_array().map_or(1, Vec::len) - 1)).collect();
    assert_eq!(users.len(), 8, "every turn's user message is new");

    let s = r.summary();
    assert_eq!((s.prompt_tokens, s.computed_prompt_tokens), (20 * 3 + 40 * 3 + 60 * 2, Some(80)), "10 per request");
    Ok(())
}

/// Retrying clients: only a 429/503 refusal is sent again. An eager client (request 0
/// of every two) ignores Retry-After and comes back after its delay, so its retries
/// are early, and the one this fake server answered is counted as served early; a
/// careful client waits out each Retry-After and names its request with an
/// Idempotency-Key. A request refused every time stops after `max` retries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retrying_clients_count_early_retries_and_keep_their_key() -> TestResult {
    let url = fake_server().await?;
    let mut p = plan(&url, &["busy-twice-eager", "busy-twice-careful", "busy"]);
    p.stream = false;
    p.arrival = Arrival::Closed { concurrency: 3 };
    p.retry = Some(loadgen::Retry { max: 2, eager_every: 2, eager_delay: Duration::from_millis(50) });
    let r = loadgen::run(&p).await?;
    assert_eq!(outcomes(&r), ["complete", "complete", "http 503 overloaded"]);
    let (eager, careful, busy) = (&r.records[0], &r.records[1], &r.records[2]);
    let counts = |r: &loadgen::Retries| (r.sent, r.early, r.early_served);
    assert_eq!(counts(&eager.retries), (2, 2, 1), "{eager:?}");
    assert_eq!(counts(&careful.retries), (2, 0, 0), "{careful:?}");
    let last = careful.retries.last_start.ok_or("a retried request has a last start")?;
    assert!(last >= careful.start + Duration::from_secs(2), "the last attempt after two waits: {careful:?}");
    assert!(careful.e2e >= Duration::from_secs(2), "two Retry-After: 1 waits: {:?}", careful.e2e);
    assert!(eager.e2e < Duration::from_secs(1), "no wait for Retry-After: {:?}", eager.e2e);
    assert_eq!(busy.retries.sent, 2, "a request refused every time stops after max retries: {busy:?}");
    let seen = BUSY_TWICE.lock().unwrap_or_else(|e| e.into_inner()).clone();
    assert_eq!(seen["eager"], vec![None, None, None], "an eager client sends no key");
    let keys = &seen["careful"];
    assert!(keys.len() == 3 && keys[0].is_some() && keys.iter().all(|k| k == &keys[0]), "one key: {keys:?}");
    Ok(())
}

/// A resuming client sends a cut stream again with its key and its last event's cursor,
/// through a broken connection, a `coordinator_draining` error event and an
/// `idempotent_original_failed` refusal: one request, its text whole and in order, three
/// resumes counted. Without `resume` the same stream is a
/// transport error; a whole request is sent again whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_clients_continue_from_their_last_cursor() -> TestResult {
    let url = fake_server().await?;
    let mut p = plan(&url, &["resume"]);
    p.resume = true;
    p.deadline = Some(Duration::from_secs(9));
    let r = loadgen::run(&p).await?;
    let rec = &r.records[0];
    assert_eq!(rec.outcome, Outcome::Complete { finish_reason: "length".into() }, "{rec:?}");
    assert_eq!(rec.text, (0..5).map(word).collect::<String>());
    assert_eq!(rec.retries.resumed, 3, "{rec:?}");
    assert_eq!(rec.retries.regenerated, 2 + 3 + 3, "each resume regenerates to its cursor: {rec:?}");
    let seen = std::mem::take(&mut *RESUMES.lock().unwrap_or_else(|e| e.into_inner()));
    let cursors: Vec<Option<&str>> = seen.iter().map(|(_, c)| c.as_deref()).collect();
    assert_eq!(cursors, [None, Some("2"), Some("3"), Some("3")]);
    assert!(seen.iter().all(|(k, _)| k.is_some() && *k == seen[0].0), "one key throughout: {seen:?}");
    // Each resume asks for the deadline left since the first attempt, not a whole one
    // again: strictly less each time (every resume pauses 50 ms or more first).
    let left = std::mem::take(&mut *RESUME_DEADLINES.lock().unwrap_or_else(|e| e.into_inner()));
    assert_eq!(left.len(), 4, "{left:?}");
    assert!(left[0] <= 9_000 && left[0] > 8_000, "the first attempt has the whole deadline: {left:?}");
    assert!(left.windows(2).all(|w| w[1] + 50 <= w[0]), "each attempt has less left: {left:?}");

    let mut p = plan(&url, &["resume"]);
    p.resume = false;
    let r = loadgen::run(&p).await?;
    assert!(matches!(r.records[0].outcome, Outcome::Transport(_)), "{:?}", r.records[0]);
    RESUMES.lock().unwrap_or_else(|e| e.into_inner()).clear();

    // A whole (non-streamed) request is sent again whole, with its key: through a broken
    // body and a 503 `shutting_down`, to its answer.
    let mut p = plan(&url, &["resume-whole"]);
    p.resume = true;
    p.stream = false;
    let r = loadgen::run(&p).await?;
    let rec = &r.records[0];
    assert_eq!(rec.outcome, Outcome::Complete { finish_reason: "stop".into() }, "{rec:?}");
    assert_eq!((rec.text.as_str(), rec.retries.resumed), ("whole", 2), "{rec:?}");
    let keys = std::mem::take(&mut *WHOLE.lock().unwrap_or_else(|e| e.into_inner()));
    assert!(keys.len() == 3 && keys.iter().all(|k| k.is_some() && *k == keys[0]), "one key, three attempts: {keys:?}");

    // A resuming client that also retries waits out a refusal's Retry-After and sends
    // the request again, with its one key.
    let mut p = plan(&url, &["busy-twice-resumer"]);
    p.resume = true;
    p.stream = false;
    p.retry = Some(loadgen::Retry { max: 3, eager_every: 0, eager_delay: Duration::ZERO });
    let r = loadgen::run(&p).await?;
    let rec = &r.records[0];
    assert_eq!(rec.outcome, Outcome::Complete { finish_reason: "stop".into() }, "{rec:?}");
    assert_eq!((rec.retries.sent, rec.retries.resumed), (2, 0), "{rec:?}");
    assert!(rec.e2e >= Duration::from_secs(2), "each retry waited its Retry-After of 1 s: {rec:?}");
    let keys = BUSY_TWICE.lock().unwrap_or_else(|e| e.into_inner()).remove("resumer").unwrap_or_default();
    assert!(keys.len() == 3 && keys.iter().all(|k| k.is_some() && *k == keys[0]), "one key, three attempts: {keys:?}");
    Ok(())
}
