//! A stream survives its coordinator: resume cursors and coordinator drain,
//! through real processes (etcd, a decode worker, two coordinators).
//!
//! - Every event of a streamed answer carries a cursor (SSE `id:`, gRPC
//!   `Chunk.cursor`); the same request sent to the other coordinator with the
//!   same Idempotency-Key (or the returned seed) and `Last-Event-ID` (gRPC
//!   `resume_cursor`) gets exactly the events after that cursor — regenerated
//!   there, or replayed from the key's record where it ran; a cursor of another
//!   answer is 409 / FAILED_PRECONDITION `resume_mismatch` with nothing sent; a
//!   resume the coordinator cannot regenerate exactly is refused naming the header.
//! - A coordinator SIGKILLed while eight 200-token streams (half sampled) run through
//!   it: every stream, resumed at the other by its client, completes token for token
//!   as the undisturbed answer.
//! - A coordinator told to drain while a peer is live ends its running streams
//!   with `coordinator_draining` carrying the cursor and seed, stops accepting,
//!   and exits long before its grace; each stream resumed at the peer completes
//!   with the undisturbed answer, over HTTP and gRPC.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "bounds on real time while real processes run")]

mod common;

use std::time::Duration;

use common::*;
use facts::metrics::coordinator::{STREAM_HANDOFFS, STREAM_RESUMES};
use proto::frontend::v1::frontend_client::FrontendClient;
use proto::frontend::v1::generate_request::Input;
use proto::frontend::v1::{generate_response, GenerateRequest, GenerateResponse};
use serde_json::{json, Value};
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

/// A worker's flags: registered in etcd under `prefix` as `id`, one compute thread.
fn decode_worker(ep: &str, prefix: &str) -> opskit::Result<Proc> {
    let args = ["--etcd", ep, "--cluster-prefix", prefix, "--lease-ttl-s", "2", "--version-group", "g1"];
    let mut args = args.to_vec();
    args.extend(["--worker-id", "d1", "--threads", "1", "--kv-blocks", "512", "--kv-load-failure-policy", "recompute"]);
    start("tandem-decode-worker", &args, &["grpc", "metrics"])
}

/// A coordinator routing from etcd under `prefix`, prefilling every prompt on the decode
/// worker, in the coordinator fleet there.
fn coordinator(ep: &str, prefix: &str, extra: &[&str]) -> opskit::Result<Proc> {
    let mut args = vec!["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--etcd", ep, "--cluster-prefix", prefix];
    args.extend(["--local-prefill-max-tokens", "1000000", "--load-poll-ms", "100", "--fleet-lease-ttl-s", "2"]);
    args.extend_from_slice(extra);
    start("tandem-coordinator", &args, &["http", "grpc"])
}

/// Waits until the coordinator at `h` routes to one serving decode worker and counts
/// `coordinators` in its fleet.
async fn serving(h: &str, coordinators: f64) -> TestResult {
    use facts::metrics::coordinator::{FLEET_SPLIT, WORKERS, WORKERS_LOAD_KNOWN};
    eventually(&format!("a serving decode worker and {coordinators} coordinators at {h}"), || {
        metric(h, WORKERS, &[("role", "decode"), ("state", "serving")]).is_ok_and(|v| v == 1.0)
            && metric(h, WORKERS_LOAD_KNOWN, &[("role", "decode")]).is_ok_and(|v| v == 1.0)
            && metric(h, FLEET_SPLIT, &[]).is_ok_and(|v| v == coordinators)
    })
    .await
}

const PROMPT: &str = "Once upon a time, in a village by the sea, there lived an old fisherman who";

/// A sampled streamed completion of `max_tokens` tokens with their logprobs.
fn completion(max_tokens: u32, seed: Option<u64>) -> Value {
    let mut b = json!({
        "model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": true, "stream": true,
        "temperature": 0.8, "top_p": 0.95, "logprobs": 0,
    });
    if let Some(s) = seed {
        b["seed"] = json!(s);
    }
    b
}

/// One SSE event as a resume compares it: its cursor and what it says, without the
/// per-coordinator request id and creation time.
#[derive(Debug, Clone, PartialEq)]
struct Ev {
    id: Option<String>,
    choices: Value,
    usage: Value,
    done: bool,
}

fn ev(e: opskit::http::SseEvent) -> Result<Ev, String> {
    if e.data == "[DONE]" {
        return Ok(Ev { id: e.id, choices: Value::Null, usage: Value::Null, done: true });
    }
    let v = json_of(&e.data)?;
    if v.get("error").is_some() {
        return Err(format!("an error event: {}", e.data));
    }
    Ok(Ev { id: e.id, choices: v["choices"].clone(), usage: v["usage"].clone(), done: false })
}

/// Posts a streamed request to `h` and reads its events: the status, the seed header,
/// and the events (or the body of a refusal).
async fn stream(h: &str, path: &str, body: &Value, headers: &[(&str, &str)]) -> Result<Streamed, String> {
    let mut req = opskit::http::Request::post(h, path).json(body).timeout(WAIT);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let mut s = req.stream().await.map_err(|e| e.to_string())?;
    let seed = s.headers.get("x-tandem-seed").and_then(|v| v.to_str().ok()).map(str::to_owned);
    if s.status != 200 {
        let status = s.status;
        return Ok(Streamed { status, seed, events: Vec::new(), refusal: s.text().await.map_err(|e| e.to_string())? });
    }
    let mut events = Vec::new();
    while let Some(e) = s.next_sse().await.map_err(|e| e.to_string())? {
        events.push(ev(e)?);
    }
    Ok(Streamed { status: 200, seed, events, refusal: String::new() })
}

#[derive(Debug)]
struct Streamed {
    status: u16,
    seed: Option<String>,
    events: Vec<Ev>,
    refusal: String,
}

/// The text of a completion's events.
fn text(events: &[Ev]) -> String {
    events.iter().filter_map(|e| e.choices[0]["text"].as_str()).collect()
}

/// A refusal's error code.
fn code(s: &Streamed) -> String {
    json_of(&s.refusal).map(|v| v["error"]["code"].as_str().unwrap_or_default().to_owned()).unwrap_or_default()
}

async fn grpc_client(g: &str) -> Result<FrontendClient<Channel>, Box<dyn std::error::Error + Send + Sync>> {
    let channel = tokio::time::timeout(WAIT, Endpoint::from_shared(format!("http://{g}"))?.connect()).await??;
    Ok(FrontendClient::new(channel))
}

/// A whole gRPC Generate stream: its messages, or the status it ended with (and
/// the messages before it).
async fn generate(c: &FrontendClient<Channel>, req: GenerateRequest) -> (Vec<GenerateResponse>, Option<tonic::Status>) {
    let mut c = c.clone();
    let mut got = Vec::new();
    let mut s = match c.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(status) => return (got, Some(status)),
    };
    loop {
        match tokio::time::timeout(WAIT, s.message()).await {
            Ok(Ok(Some(m))) => got.push(m),
            Ok(Ok(None)) => return (got, None),
            Ok(Err(status)) => return (got, Some(status)),
            Err(_) => return (got, Some(tonic::Status::deadline_exceeded("the test's bound"))),
        }
    }
}

fn grpc_cursor(m: &GenerateResponse) -> &str {
    match &m.event {
        Some(generate_response::Event::Chunk(c)) => &c.cursor,
        Some(generate_response::Event::Done(d)) => &d.cursor,
        None => "",
    }
}

fn grpc_text(ms: &[GenerateResponse]) -> String {
    ms.iter()
        .filter_map(|m| match &m.event {
            Some(generate_response::Event::Chunk(c)) => Some(c.text.as_str()),
            _ => None,
        })
        .collect()
}

fn grpc_request(max_tokens: u32, key: &str) -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        input: Some(Input::Prompt(PROMPT.into())),
        max_tokens: Some(max_tokens),
        temperature: Some(0.8),
        top_p: Some(0.95),
        ignore_eos: true,
        idempotency_key: key.into(),
        ..GenerateRequest::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_resume_at_another_coordinator_from_their_cursor() -> TestResult {
    let etcd = opskit::etcd::Etcd::start().await?;
    let ep = etcd.endpoint();
    let _d = decode_worker(&ep, "resume")?;
    let (a, b) = (coordinator(&ep, "resume", &[])?, coordinator(&ep, "resume", &[])?);
    let (ha, hb) = (a.addr("http")?, b.addr("http")?);
    serving(&ha, 2.0).await?;
    serving(&hb, 2.0).await?;
    let path = "/v1/completions";

    // The undisturbed answer, at A, under a key.
    let key = format!("resume-{}", unique());
    let body = completion(40, None);
    let first = stream(&ha, path, &body, &[("idempotency-key", &key)]).await?;
    assert_eq!(first.status, 200, "{}", first.refusal);
    let events = first.events;
    assert!(events.len() > 30 && events.last().is_some_and(|e| e.done), "{events:?}");
    let ids: Vec<&str> = events.iter().map(|e| e.id.as_deref().expect("every event has a cursor")).collect();
    let unique_ids: std::collections::HashSet<&&str> = ids.iter().collect();
    assert_eq!(unique_ids.len(), ids.len(), "every event's cursor is its own: {ids:?}");
    assert!(ids[0].starts_with("1-"), "the first token's event stands at token 1: {ids:?}");
    assert!(ids.last().is_some_and(|i| i.starts_with("40-") && i.contains('.')), "[DONE] after 40 tokens: {ids:?}");

    // Resumed at B from several cursors: exactly the rest. The first resume regenerates
    // (B never saw the key); the later ones replay B's record of it.
    let n = events.len();
    for k in [n / 2, 0, n - 3, n - 1] {
        let at = ids[k];
        let r = stream(&hb, path, &body, &[("idempotency-key", &key), ("last-event-id", at)]).await?;
        assert_eq!(r.status, 200, "resumed after event {k} ({at}): {}", r.refusal);
        assert_eq!(r.seed, first.seed, "the key's seed, at either coordinator");
        assert_eq!(r.events, events[k + 1..], "resumed after event {k} ({at})");
    }
    // At A, from its own record of the key.
    let r = stream(&ha, path, &body, &[("idempotency-key", &key), ("last-event-id", ids[3])]).await?;
    assert_eq!(r.events, events[4..], "resumed at A from its record");

    // With the returned seed instead of a key.
    let seed: u64 = first.seed.as_deref().expect("the seed header").parse()?;
    let r = stream(&hb, path, &completion(40, Some(seed)), &[("last-event-id", ids[10])]).await?;
    assert_eq!(r.events, events[11..], "resumed by the seed");

    // Another answer at the cursor: refused before anything is sent — regenerated with
    // another key's seed, from a hash changed by one digit, and replayed against a
    // cursor that is not in the record.
    let flip = |id: &str| {
        let (n, h) = id.split_once('-').unwrap();
        let c = if h.starts_with('0') { '1' } else { '0' };
        format!("{n}-{c}{}", &h[1..])
    };
    let other_key = format!("resume-other-{}", unique());
    for (h, k, at, what) in [
        (&hb, other_key.as_str(), ids[10].to_owned(), "another seed"),
        (&hb, key.as_str(), flip(ids[10]), "a changed hash, replayed"),
        (&hb, "resume-fresh-key", flip(ids[10]), "a changed hash, regenerated"),
        (&hb, key.as_str(), "999-0000000000000000".to_owned(), "a cursor past the answer's end"),
    ] {
        let r = stream(h, path, &body, &[("idempotency-key", k), ("last-event-id", &at)]).await?;
        assert_eq!((r.status, code(&r).as_str()), (409, "resume_mismatch"), "{what}: {r:?}");
    }
    // A resume that cannot be regenerated exactly, or a cursor that is not one.
    for (b, headers, what) in [
        (completion(40, None), vec![("last-event-id", ids[3])], "no key, no seed"),
        (json!({"model": MODEL, "prompt": PROMPT, "seed": 1}), vec![("last-event-id", ids[3])], "not streamed"),
        (body.clone(), vec![("idempotency-key", key.as_str()), ("last-event-id", "17")], "not a cursor"),
    ] {
        let r = stream(&hb, path, &b, &headers).await?;
        assert_eq!(r.status, 400, "{what}: {r:?}");
        error_of(r.status, &r.refusal, 400, Some("Last-Event-ID"))?;
    }

    // Chat: the role chunk has a cursor of its own (no token yet).
    let chat = json!({
        "model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 24,
        "ignore_eos": true, "stream": true, "temperature": 0.7,
    });
    let chat_key = format!("resume-chat-{}", unique());
    let c = stream(&ha, "/v1/chat/completions", &chat, &[("idempotency-key", &chat_key)]).await?;
    let c0 = c.events[0].id.clone().expect("a cursor");
    assert!(c0.starts_with("0-"), "{c0}");
    let r =
        stream(&hb, "/v1/chat/completions", &chat, &[("idempotency-key", &chat_key), ("last-event-id", &c0)]).await?;
    assert_eq!(r.events, c.events[1..], "chat resumed after its role chunk");

    // gRPC: the same, with Chunk.cursor and resume_cursor.
    let (ga, gb) = (grpc_client(&a.addr("grpc")?).await?, grpc_client(&b.addr("grpc")?).await?);
    let gkey = format!("resume-grpc-{}", unique());
    let (msgs, status) = generate(&ga, grpc_request(32, &gkey)).await;
    assert!(status.is_none(), "{status:?}");
    let cursors: Vec<&str> = msgs.iter().map(grpc_cursor).collect();
    assert!(cursors.iter().all(|c| !c.is_empty()), "{cursors:?}");
    for k in [0, msgs.len() / 2, msgs.len() - 2] {
        let req = GenerateRequest { resume_cursor: cursors[k].into(), ..grpc_request(32, &gkey) };
        let (rest, status) = generate(&gb, req).await;
        assert!(status.is_none(), "resumed after message {k}: {status:?}");
        assert_eq!(rest, msgs[k + 1..], "gRPC resumed after message {k}");
    }
    let req = GenerateRequest { resume_cursor: flip(cursors[5]), ..grpc_request(32, &gkey) };
    let (rest, status) = generate(&gb, req).await;
    let status = status.expect("refused");
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");
    assert!(rest.is_empty() && status.message().starts_with("resume_mismatch"), "{status:?}");
    let req = GenerateRequest { resume_cursor: cursors[5].into(), ..grpc_request(32, "") };
    let (_, status) = generate(&gb, req).await;
    assert_eq!(status.map(|s| s.code()), Some(Code::InvalidArgument), "no key, no seed");

    let resumes = |outcome, api| metric(&hb, STREAM_RESUMES, &[("api", api), ("outcome", outcome)]);
    assert!(resumes("ok", "http")? >= 6.0 && resumes("mismatch", "http")? >= 4.0, "{}", resumes("ok", "http")?);
    assert!(resumes("ok", "grpc")? >= 3.0 && resumes("mismatch", "grpc")? >= 1.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_coordinator_hands_its_streams_to_a_peer() -> TestResult {
    let etcd = opskit::etcd::Etcd::start().await?;
    let ep = etcd.endpoint();
    let _d = decode_worker(&ep, "handoff")?;
    let mut a = coordinator(&ep, "handoff", &["--shutdown-timeout-ms", "60000"])?;
    let b = coordinator(&ep, "handoff", &[])?;
    let (ha, hb) = (a.addr("http")?, b.addr("http")?);
    serving(&ha, 2.0).await?;
    serving(&hb, 2.0).await?;
    let path = "/v1/completions";

    // Undisturbed answers, at B: one greedy, one seeded sampled (explicit seeds, so the
    // resumes need no key of B's).
    let bodies = [
        json!({"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": true,
                         "stream": true, "temperature": 0}),
        completion(200, Some(77)),
    ];
    let mut want = Vec::new();
    for body in &bodies {
        let r = stream(&hb, path, body, &[]).await?;
        assert_eq!(r.status, 200, "{}", r.refusal);
        want.push(text(&r.events));
    }
    let gwant = {
        let gb = grpc_client(&b.addr("grpc")?).await?;
        let (m, status) = generate(&gb, GenerateRequest { seed: Some(5), ..grpc_request(200, "") }).await;
        assert!(status.is_none(), "{status:?}");
        grpc_text(&m)
    };

    // The same, streaming from A; SIGTERM to A once each has sent a few events.
    let mut open = Vec::new();
    for body in &bodies {
        let s = opskit::http::Request::post(&ha, path).json(body).timeout(WAIT).stream().await?;
        assert_eq!(s.status, 200);
        open.push(s);
    }
    let ga = grpc_client(&a.addr("grpc")?).await?;
    let mut gs = ga.clone().generate(GenerateRequest { seed: Some(5), ..grpc_request(200, "") }).await?.into_inner();
    let mut had = Vec::new();
    for s in &mut open {
        let mut events = Vec::new();
        while events.len() < 4 {
            events.push(ev(s.next_sse().await?.expect("an event"))?);
        }
        had.push(events);
    }
    let mut ghad = vec![gs.message().await?.expect("a message")];
    a.signal(Signal::Term)?;
    // A's exit is timed on its own, not through the resumes this test runs at B meanwhile
    // (three 200-token regenerations, slow on a loaded machine).
    let term = tokio::time::Instant::now();
    let a_exit = tokio::spawn(async move {
        let exit = a.wait_exit(Duration::from_secs(60)).await;
        (exit, term.elapsed())
    });

    // Each stream ends with coordinator_draining, its last cursor and its seed.
    for ((mut s, mut events), (body, want)) in open.into_iter().zip(had).zip(bodies.iter().zip(&want)) {
        let end = loop {
            let e = s.next_sse().await?.expect("the stream ends with an error event, not silently");
            match ev(e.clone()) {
                Ok(x) => events.push(x),
                Err(_) => break e,
            }
        };
        let err = json_of(&end.data)?;
        assert_eq!(err["error"]["code"], "coordinator_draining", "{err}");
        let cursor = events.last().and_then(|e| e.id.clone()).expect("events had cursors");
        assert_eq!(err["error"]["cursor"], json!(cursor), "the error names the last event's cursor");
        assert_eq!(end.id.as_deref(), Some(cursor.as_str()), "the error event sets no cursor of its own");
        assert!(err["error"]["seed"].is_u64(), "{err}");
        let mut body = body.clone();
        body["seed"] = err["error"]["seed"].clone();
        let rest = stream(&hb, path, &body, &[("last-event-id", &cursor)]).await?;
        assert_eq!(rest.status, 200, "{}", rest.refusal);
        assert_eq!(text(&events) + &text(&rest.events), *want, "the resumed stream is the undisturbed answer");
    }
    let status = loop {
        match gs.message().await {
            Ok(Some(m)) => ghad.push(m),
            Ok(None) => panic!("the gRPC stream ended without a status"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let md = |k: &str| status.metadata().get(k).and_then(|v| v.to_str().ok()).map(str::to_owned);
    assert_eq!(md("x-tandem-error-code").as_deref(), Some("coordinator_draining"), "{status:?}");
    assert_eq!(md("x-tandem-cursor").as_deref(), ghad.last().map(grpc_cursor), "{status:?}");
    assert_eq!(md("x-tandem-seed").as_deref(), Some("5"));
    let gb = grpc_client(&b.addr("grpc")?).await?;
    let req = GenerateRequest {
        seed: Some(5),
        resume_cursor: md("x-tandem-cursor").unwrap_or_default(),
        ..grpc_request(200, "")
    };
    let (rest, st) = generate(&gb, req).await;
    assert!(st.is_none(), "{st:?}");
    assert_eq!(grpc_text(&ghad) + &grpc_text(&rest), gwant, "the resumed gRPC stream is the undisturbed answer");

    // A is gone long before its 60 s grace, and took no new connection meanwhile.
    let (exit, took) = a_exit.await?;
    let exit = exit?;
    assert!(exit.success(), "{exit:?}");
    assert!(took < Duration::from_secs(20), "A exited {took:?} after SIGTERM");
    assert!(std::net::TcpStream::connect(&ha).is_err(), "A's HTTP port is closed");
    assert_eq!(metric(&hb, STREAM_HANDOFFS, &[("api", "http")])?, 0.0, "B handed nothing off");
    Ok(())
}

/// The token pieces of a completion's events (`logprobs.content[].token`): the answer's
/// tokens as the API shows them.
fn pieces(events: &[Ev]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| e.choices[0]["logprobs"]["content"].as_array())
        .flatten()
        .map(|t| t["token"].as_str().unwrap_or_default().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_cut_by_a_killed_coordinator_resume_token_for_token() -> TestResult {
    let etcd = opskit::etcd::Etcd::start().await?;
    let ep = etcd.endpoint();
    let _d = decode_worker(&ep, "killed")?;
    let mut a = coordinator(&ep, "killed", &[])?;
    let b = coordinator(&ep, "killed", &[])?;
    let (ha, hb) = (a.addr("http")?, b.addr("http")?);
    serving(&ha, 2.0).await?;
    serving(&hb, 2.0).await?;
    let path = "/v1/completions";
    // Eight 200-token streams, every second one sampled with its own seed.
    let bodies: Vec<Value> = (0..8u64)
        .map(|i| {
            let mut b = completion(200, (i % 2 == 1).then_some(100 + i));
            if i % 2 == 0 {
                b["temperature"] = json!(0);
            }
            b
        })
        .collect();
    let undisturbed = futures_util::future::join_all(bodies.iter().map(|b| stream(&hb, path, b, &[]))).await;
    let want: Vec<Vec<String>> =
        undisturbed.into_iter().map(|r| r.map(|r| pieces(&r.events))).collect::<Result<_, _>>()?;
    assert!(want.iter().all(|w| w.len() == 200), "{:?}", want.iter().map(Vec::len).collect::<Vec<_>>());

    let keys: Vec<String> = (0..8).map(|i| format!("killed-{}-{i}", unique())).collect();
    let mut open = Vec::new();
    for (body, key) in bodies.iter().zip(&keys) {
        let s = opskit::http::Request::post(&ha, path).json(body).header("idempotency-key", key).timeout(WAIT);
        open.push(s.stream().await?);
    }
    let mut had = vec![Vec::new(); open.len()];
    for (s, h) in open.iter_mut().zip(&mut had) {
        while h.len() < 3 {
            h.push(ev(s.next_sse().await?.expect("an event"))?);
        }
    }
    a.kill9().await?;
    for (i, mut s) in open.into_iter().enumerate() {
        // What was on its way before the kill, then the cut: no end, no error event.
        while let Ok(Some(e)) = s.next_sse().await {
            had[i].push(ev(e)?);
        }
        assert!(had[i].last().is_some_and(|e| !e.done), "stream {i} was cut before its end");
    }
    let resumed =
        futures_util::future::join_all(bodies.iter().zip(&keys).zip(&had).map(|((body, key), h)| {
            let at = h.last().and_then(|e| e.id.clone()).unwrap_or_default();
            let hb = hb.clone();
            async move {
                stream(&hb, path, body, &[("idempotency-key", key.as_str()), ("last-event-id", at.as_str())]).await
            }
        }))
        .await;
    for (i, r) in resumed.into_iter().enumerate() {
        let r = r?;
        assert_eq!(r.status, 200, "stream {i}: {}", r.refusal);
        let mut got = pieces(&had[i]);
        got.extend(pieces(&r.events));
        assert_eq!(
            got, want[i],
            "stream {i}: the tokens before the kill and after the resume are the undisturbed answer"
        );
    }
    Ok(())
}
