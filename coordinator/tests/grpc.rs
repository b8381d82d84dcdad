//! The real `tandem-coordinator`'s gRPC frontend in front of a real prefill
//! and decode worker pair on loopback: greedy `Generate` equal to the HTTP
//! API's answer and to the single-process engine's; `ListModels`; the
//! standard health service turning SERVING; reflection listing the
//! services; refusals mapped to gRPC status codes with their metadata;
//! admission shedding with `retry-after`; a client that goes away
//! cancelling its request on the decode worker; and SIGTERM draining.
//!
//! One cluster serves every case (CI has 2 cores). The worker binaries come
//! from the same target directory (`make test` builds every binary first).
//! Every wait is bounded and says what did not happen; nothing sleeps.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use common::{
    counter_before, eventually, metric, post, record, reference, start_pair, Pair, Signal, TestResult, MODEL, WAIT,
};
use engine::tokenizer::Tokenizer;
use engine::weights::Weights;
use facts::metrics::decode::DECODE_REQUESTS;
use proto::frontend::v1::frontend_client::FrontendClient;
use proto::frontend::v1::generate_request::Input;
use proto::frontend::v1::{
    generate_response, ChatMessage, ChatMessages, Chunk, Done, FinishReason, GenerateRequest, ListModelsRequest,
    TokenIds,
};
use serde_json::json;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// Awaits `f` for at most [`WAIT`]; the error names what did not happen.
async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> Result<T, String> {
    tokio::time::timeout(WAIT, f).await.map_err(|_| format!("{what} did not happen within {WAIT:?}"))
}

/// A whole Generate stream.
#[derive(Debug, Default)]
struct Answer {
    text: String,
    chunks: Vec<Chunk>,
    done: Option<Done>,
}

impl Answer {
    fn token_ids(&self) -> usize {
        self.chunks.iter().map(|c| c.token_ids.len()).sum()
    }
}

/// Runs one Generate to its end (or its status), with `grpc-timeout` when given.
async fn generate(
    c: &FrontendClient<Channel>,
    req: GenerateRequest,
    timeout: Option<Duration>,
) -> Result<Result<Answer, Status>, String> {
    let mut c = c.clone();
    bounded("a Generate answer", async move {
        let mut r = tonic::Request::new(req);
        if let Some(t) = timeout {
            r.set_timeout(t);
        }
        let mut stream = c.generate(r).await?.into_inner();
        let mut a = Answer::default();
        while let Some(m) = stream.message().await? {
            match m.event {
                Some(generate_response::Event::Chunk(ch)) => {
                    assert!(a.done.is_none(), "a chunk after Done");
                    a.text.push_str(&ch.text);
                    a.chunks.push(ch);
                }
                Some(generate_response::Event::Done(d)) => {
                    assert!(a.done.is_none(), "two Done events");
                    a.done = Some(d);
                }
                None => return Err(Status::internal("an empty event")),
            }
        }
        Ok(a)
    })
    .await
}

fn prompt_req(prompt: &str, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        model: MODEL.into(),
        input: Some(Input::Prompt(prompt.into())),
        max_tokens: Some(max_tokens),
        temperature: Some(0.0),
        ..GenerateRequest::default()
    }
}

/// The status of a refused request, checked against the wanted code and
/// `x-tandem-error-*` metadata.
fn refused(
    r: Result<Answer, Status>,
    code: Code,
    error_code: Option<&str>,
    param: Option<&str>,
) -> Result<Status, String> {
    let s = match r {
        Ok(a) => return Err(format!("wanted {code:?}, got an answer: {a:?}")),
        Err(s) => s,
    };
    let md = |k: &str| s.metadata().get(k).and_then(|v| v.to_str().ok()).map(str::to_owned);
    assert_eq!(s.code(), code, "{s:?}");
    assert!(!s.message().is_empty(), "{s:?}");
    assert!(md("x-tandem-error-type").is_some(), "{s:?}");
    if let Some(c) = error_code {
        assert_eq!(md("x-tandem-error-code").as_deref(), Some(c), "{s:?}");
        assert!(s.message().starts_with(c), "the message leads with the code: {s:?}");
    }
    if let Some(p) = param {
        assert_eq!(md("x-tandem-error-param").as_deref(), Some(p), "{s:?}");
    }
    Ok(s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_frontend_through_a_prefill_decode_pair() -> TestResult {
    let path = engine::paths::default_model_path();
    let (_, gguf) = Weights::from_gguf(&path)?;
    let tok = Tokenizer::from_gguf(&gguf)?;
    // One request running and one queued at a time, so that queueing and
    // shedding can be shown; a drain grace far longer than the drain may take.
    let Pair { prefill, decode, coord } = start_pair(
        "256",
        &["--max-running", "1", "--max-queued", "1", "--shutdown-timeout-ms", "60000", "--max-body-bytes", "65536"],
    )?;
    let (h, g) = (coord.addr("http")?, coord.addr("grpc")?);
    let channel =
        bounded("connecting to the gRPC frontend", Endpoint::from_shared(format!("http://{g}"))?.connect()).await??;
    let client = FrontendClient::new(channel.clone());

    // Health: SERVING (watched, not polled) once the decode worker answers ready.
    let mut health = HealthClient::new(channel.clone());
    let service = "tandem.frontend.v1.Frontend".to_owned();
    let mut watch = health.watch(HealthCheckRequest { service: service.clone() }).await?.into_inner();
    bounded("health SERVING for the frontend", async {
        while let Some(r) = watch.message().await? {
            if r.status == ServingStatus::Serving as i32 {
                return Ok(());
            }
        }
        Err(Status::internal("the watch ended"))
    })
    .await??;
    let overall = health.check(HealthCheckRequest { service: String::new() }).await?.into_inner();
    assert_eq!(overall.status, ServingStatus::Serving as i32, "the server as a whole");

    let cx = Arc::new(Cx {
        client,
        channel,
        h: h.clone(),
        tok,
        decode_metrics: decode.addr("metrics")?,
        service: service.clone(),
        workers: (decode.addr("grpc")?, prefill.addr("grpc")?),
    });

    // Each part runs in a task of its own, on this one cluster: a failed
    // assertion fails its part, and the parts after it still run, so one
    // failure does not hide the others. SIGTERM comes last (it stops the
    // coordinator).
    let mut failed = Vec::new();
    for (name, part) in [
        ("models and reflection", tokio::spawn(models_and_reflection(cx.clone()))),
        ("completions", tokio::spawn(completions(cx.clone()))),
        ("chat with logprobs", tokio::spawn(chat_with_logprobs(cx.clone()))),
        ("refusals", tokio::spawn(refusals(cx.clone()))),
        ("a Python client", tokio::spawn(python_client(cx.clone()))),
    ] {
        record(&mut failed, name, part.await);
    }
    // These two share the one running seat: one after the other.
    record(&mut failed, "admission", tokio::spawn(admission(cx.clone())).await);
    record(&mut failed, "deadline", tokio::spawn(deadline(cx.clone())).await);
    record(&mut failed, "SIGTERM drain", tokio::spawn(drain(cx.clone(), coord, watch)).await);
    assert!(failed.is_empty(), "{} part(s) failed:\n{}", failed.len(), failed.join("\n"));
    Ok(())
}

/// What every part needs of the cluster.
struct Cx {
    client: FrontendClient<Channel>,
    channel: Channel,
    h: String,
    tok: Tokenizer,
    decode_metrics: String,
    service: String,
    /// The decode and prefill workers' gRPC addresses.
    workers: (String, String),
}

const PROMPT: &str = "The capital of France is";

/// ListModels, and reflection listing what this server runs.
async fn models_and_reflection(cx: Arc<Cx>) -> TestResult {
    let client = cx.client.clone();
    let channel = cx.channel.clone();
    let service = cx.service.clone();
    // ListModels.
    let models = client.clone().list_models(ListModelsRequest {}).await?.into_inner();
    assert_eq!(models.models.iter().map(|m| m.id.as_str()).collect::<Vec<_>>(), [MODEL]);

    // Reflection (v1 and v1alpha) lists what this server runs, not the worker API.
    {
        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
        use tonic_reflection::pb::v1::ServerReflectionRequest;
        let reqs = [MessageRequest::ListServices(String::new()), MessageRequest::FileContainingSymbol(service.clone())]
            .map(|m| ServerReflectionRequest { host: String::new(), message_request: Some(m) });
        let mut r = ServerReflectionClient::new(channel.clone());
        let mut answers = r.server_reflection_info(tokio_stream::iter(reqs)).await?.into_inner();
        let listed = match answers.message().await?.and_then(|m| m.message_response) {
            Some(MessageResponse::ListServicesResponse(l)) => l.service.into_iter().map(|s| s.name).collect::<Vec<_>>(),
            other => return Err(format!("list_services answered {other:?}").into()),
        };
        for want in [service.as_str(), "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"] {
            assert!(listed.iter().any(|s| s == want), "{want} not in {listed:?}");
        }
        assert!(!listed.iter().any(|s| s.starts_with("tandem.worker")), "{listed:?}");
        match answers.message().await?.and_then(|m| m.message_response) {
            Some(MessageResponse::FileDescriptorResponse(f)) => assert!(!f.file_descriptor_proto.is_empty()),
            other => return Err(format!("file_containing_symbol answered {other:?}").into()),
        }

        use tonic_reflection::pb::v1alpha::server_reflection_client::ServerReflectionClient as AlphaClient;
        use tonic_reflection::pb::v1alpha::server_reflection_request::MessageRequest as AlphaRequest;
        use tonic_reflection::pb::v1alpha::server_reflection_response::MessageResponse as AlphaResponse;
        let req = tonic_reflection::pb::v1alpha::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(AlphaRequest::ListServices(String::new())),
        };
        let mut r = AlphaClient::new(channel.clone());
        let mut answers = r.server_reflection_info(tokio_stream::iter([req])).await?.into_inner();
        match answers.message().await?.and_then(|m| m.message_response) {
            Some(AlphaResponse::ListServicesResponse(l)) => assert!(l.service.iter().any(|s| s.name == service)),
            other => return Err(format!("v1alpha list_services answered {other:?}").into()),
        }
    }

    Ok(())
}

/// Greedy completion: the engine's answer, and the HTTP API's, token for token.
async fn completions(cx: Arc<Cx>) -> TestResult {
    let client = cx.client.clone();
    let h = cx.h.as_str();
    let tok = &cx.tok;
    let prompt = PROMPT;
    // Greedy completion: the engine's answer, and the HTTP API's, token for token.
    let pids = tok.encode(prompt, false)?;
    let want = reference(tok, &pids, 16)?;
    let a = generate(&client, GenerateRequest { include_usage: true, ..prompt_req(prompt, 16) }, None).await??;
    assert_eq!(a.text, want, "gRPC differs from the single-process engine");
    let (s, _, body) =
        post(h, "/v1/completions", &json!({"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0}))?;
    assert_eq!(s, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(v["choices"][0]["text"], a.text.as_str(), "gRPC differs from HTTP");
    let done = a.done.as_ref().ok_or("no Done")?;
    assert_eq!(
        v["choices"][0]["finish_reason"],
        if done.finish_reason() == FinishReason::Stop { "stop" } else { "length" }
    );
    let usage = done.usage.ok_or("include_usage set, no usage")?;
    assert_eq!(usage.prompt_tokens as usize, pids.len());
    assert_eq!(usage.completion_tokens as usize, a.token_ids(), "one token id per generated token");
    assert_eq!(usage.total_tokens, usage.prompt_tokens + usage.completion_tokens);
    // The same prompt as token ids; usage only when asked for.
    let by_ids = GenerateRequest { input: Some(Input::TokenIds(TokenIds { ids: pids.clone() })), ..prompt_req("", 16) };
    let b = generate(&client, by_ids, None).await??;
    assert_eq!(b.text, want, "token-id input");
    assert!(b.done.as_ref().is_some_and(|d| d.usage.is_none()), "{:?}", b.done);

    Ok(())
}

/// Chat with logprobs: the HTTP chat answer, each token with 2 alternatives.
async fn chat_with_logprobs(cx: Arc<Cx>) -> TestResult {
    let client = cx.client.clone();
    let h = cx.h.as_str();
    // Chat with logprobs: the HTTP chat answer, each token with 2 alternatives.
    let question = "What is the capital of France?";
    let chat = GenerateRequest {
        input: Some(Input::Messages(ChatMessages {
            messages: vec![ChatMessage { role: "user".into(), content: question.into() }],
        })),
        logprobs: Some(2),
        ..prompt_req("", 12)
    };
    let c = generate(&client, chat, None).await??;
    let hreq = json!({"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0});
    let (s, _, body) = post(h, "/v1/chat/completions", &hreq)?;
    assert_eq!(s, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body)?;
    assert_eq!(v["choices"][0]["message"]["content"], c.text.as_str(), "gRPC chat differs from HTTP");
    for ch in &c.chunks {
        assert_eq!(ch.logprobs.len(), ch.token_ids.len(), "{ch:?}");
        for l in &ch.logprobs {
            assert!(l.logprob.is_some_and(|p| p <= 0.0) && l.top.len() == 2, "{l:?}");
        }
    }

    Ok(())
}

/// Refusals: each a status code with the OpenAI code and field as metadata.
async fn refusals(cx: Arc<Cx>) -> TestResult {
    let client = cx.client.clone();
    let prompt = PROMPT;
    // Refusals: each a status code with the OpenAI code and field as metadata.
    let r = generate(&client, GenerateRequest { model: "gpt-9".into(), ..prompt_req(prompt, 4) }, None).await?;
    refused(r, Code::NotFound, Some("model_not_found"), Some("model"))?;
    let r = generate(&client, GenerateRequest { temperature: Some(5.0), ..prompt_req(prompt, 4) }, None).await?;
    refused(r, Code::InvalidArgument, Some("invalid_value"), Some("temperature"))?;
    let r = generate(&client, GenerateRequest { input: None, ..prompt_req(prompt, 4) }, None).await?;
    refused(r, Code::InvalidArgument, Some("invalid_value"), Some("input"))?;
    let r = generate(&client, prompt_req(prompt, 100_000), None).await?;
    refused(r, Code::InvalidArgument, Some("context_length_exceeded"), Some("prompt"))?;
    // gRPC's status table: a message over the cap is RESOURCE_EXHAUSTED (tonic says OUT_OF_RANGE).
    let big = GenerateRequest { input: Some(Input::Prompt("x".repeat(70_000))), ..prompt_req("", 4) };
    let r = generate(&client, big, None).await?;
    refused(r, Code::ResourceExhausted, Some("request_too_large"), None)?;
    let mut bad_timeout = tonic::Request::new(prompt_req(prompt, 4));
    bad_timeout.metadata_mut().insert("grpc-timeout", "soon".parse()?);
    let r = bounded("an answer to a bad grpc-timeout", client.clone().generate(bad_timeout)).await?;
    refused(r.map(|_| Answer::default()), Code::InvalidArgument, Some("invalid_value"), Some("grpc-timeout"))?;
    // A call without its one request message: UNIMPLEMENTED (tonic says INTERNAL).
    let mut raw = tonic::client::Grpc::new(cx.channel.clone());
    bounded("the raw client ready", raw.ready()).await??;
    let none = tonic::Request::new(tokio_stream::empty::<GenerateRequest>());
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/tandem.frontend.v1.Frontend/Generate");
    let codec = tonic_prost::ProstCodec::<GenerateRequest, proto::frontend::v1::GenerateResponse>::default();
    let r = bounded("an answer to a call without a message", raw.streaming(none, path, codec)).await?;
    let s = r.err().ok_or("a call without a request message was answered")?;
    assert_eq!(s.code(), Code::Unimplemented, "{s:?}");
    assert_eq!(s.metadata().get("x-tandem-error-code").and_then(|v| v.to_str().ok()), Some("cardinality_violation"));

    Ok(())
}

/// The tenants of the Python client's coordinator: open, capped at 4 tokens, and
/// one request per 5 s (with the least burst, two).
const TENANTS: &str = r#"
[tenants.open]
keys = ["sk-open"]
[tenants.capped]
keys = ["sk-capped"]
max_tokens = 4
[tenants.slow]
keys = ["sk-slow"]
requests_per_s = 0.2
"#;

/// A Python grpcio client (tests/grpc_client.py) calls every RPC of a second
/// coordinator in front of the same workers — one with tenants and a gRPC max
/// connection age of 1.5 s — on one channel for 4 s; every gRPC call it made is in
/// that coordinator's request series under the HTTP status and code its outcome has
/// there, and its channel reconnected after the GOAWAY without losing a call.
async fn python_client(cx: Arc<Cx>) -> TestResult {
    let Some(python) = std::env::var_os("TANDEM_PYTHON") else {
        return Err("TANDEM_PYTHON is not set: make test sets it (scripts/python-deps.sh)".into());
    };
    let dir = std::env::temp_dir().join(format!("tandem-grpc-python-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let tenants = dir.join("tenants.toml");
    std::fs::write(&tenants, TENANTS)?;
    let (d, p) = &cx.workers;
    let tenants_arg = tenants.to_string_lossy().into_owned();
    let args = [
        "--http",
        "127.0.0.1:0",
        "--grpc",
        "127.0.0.1:0",
        "--decode",
        d,
        "--prefill",
        p,
        "--tenants",
        &tenants_arg,
        "--max-body-bytes",
        "65536",
        "--grpc-max-connection-age-ms",
        "1500",
    ];
    let coord = common::start("tandem-coordinator", &args, &["http", "grpc"])?;
    let (h, g) = (coord.addr("http")?, coord.addr("grpc")?);
    eventually("the second coordinator ready", || {
        common::http(&h, "GET", "/ready", "", b"", &[]).is_ok_and(|r| r.0 == 200)
    })
    .await?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/grpc_client.py");
    let out = tokio::process::Command::new(python)
        .args([script, &g, MODEL, "sk-open", "sk-capped", "sk-slow", &dir.to_string_lossy(), "4"])
        .kill_on_drop(true)
        .output();
    let out = bounded("the Python client", out).await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the Python client failed ({}):\n{stderr}", out.status);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("{e}: {stderr}"))?;

    use facts::metrics::coordinator::{GRPC_CONNECTIONS, IDEMPOTENT_REPLAYS, REQUESTS};
    let page = opskit::prom::scrape_within(&h, WAIT).await?;
    let grpc = |status: &str, code: &str| page.sum(REQUESTS, &[("api", "grpc"), ("status", status), ("code", code)]);
    // Every answered Generate counted ok (the replayed one too), each refusal under its code.
    assert_eq!(grpc("200", "ok")?, report["generate_ok"].as_f64().unwrap_or(-1.0), "{report}");
    for (status, code) in [
        ("400", "invalid_value"),
        ("422", "idempotency_key_reused"),
        ("404", "model_not_found"),
        ("413", "request_too_large"),
        ("400", "max_tokens_too_large"),
        ("429", "rate_limit_requests"),
    ] {
        let want = if code == "rate_limit_requests" { 2.0 } else { 1.0 };
        assert_eq!(grpc(status, code)?, want, "{REQUESTS}{{api=grpc,status={status},code={code}}}: {report}");
    }
    // The 50 ms deadline: the coordinator's 504, or the client's cancel first (499).
    let deadline = page.absent_as_zero(REQUESTS, &[("api", "grpc"), ("status", "504"), ("code", "deadline_exceeded")])
        + page.absent_as_zero(REQUESTS, &[("api", "grpc"), ("status", "499"), ("code", "client_closed")]);
    assert_eq!(deadline, 1.0, "the deadline call counted once");
    assert!(page.sum(IDEMPOTENT_REPLAYS, &[])? >= 1.0, "the keyed retry was a replay");
    let connections = page.get(GRPC_CONNECTIONS, &[])?;
    assert!(connections >= 2.0, "one channel for 4 s past a 1.5 s max connection age reconnected: {connections}");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Admission with one seat and a queue of one.
async fn admission(cx: Arc<Cx>) -> TestResult {
    let client = cx.client.clone();
    let h = cx.h.as_str();
    let metrics = cx.decode_metrics.as_str();
    let prompt = PROMPT;
    // Admission: with the one slot taken, the next request queues and the
    // one after is shed as UNAVAILABLE + retry-after (queue full). Then the
    // first client goes away: the decode worker sees the request cancelled
    // (not run to its 1000 tokens), and the queued one runs.
    let cancelled = [("outcome", "cancelled")];
    let before = counter_before(metrics, DECODE_REQUESTS, &cancelled)?;
    let long = GenerateRequest { ignore_eos: true, ..prompt_req("Once upon a time", 1000) };
    let mut first = client.clone();
    let mut stream = bounded("the long request starting", first.generate(long)).await??.into_inner();
    bounded("the long request's first chunk", stream.message()).await??.ok_or("the long request ended at once")?;
    let queued = {
        let client = client.clone();
        let req = prompt_req(prompt, 2);
        tokio::spawn(async move { generate(&client, req, None).await })
    };
    eventually("the second request waiting in the queue", || {
        metric(h, facts::metrics::coordinator::QUEUE_DEPTH, &[]).is_ok_and(|n| n == 1.0)
    })
    .await?;
    let r = generate(&client, prompt_req(prompt, 1), None).await?;
    let s = refused(r, Code::Unavailable, Some("queue_full"), None)?;
    let retry_after = s.metadata().get("retry-after").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    assert!(retry_after.is_some_and(|r| (1..=60).contains(&r)), "{s:?}");
    // The same call again at once, before its retry-after: refused cheaply as too soon.
    let r = generate(&client, prompt_req(prompt, 1), None).await?;
    let s = refused(r, Code::ResourceExhausted, Some("retry_too_soon"), None)?;
    let again = s.metadata().get("retry-after").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    assert!(again.is_some_and(|a| a >= 1 && Some(a) <= retry_after), "{again:?} after {retry_after:?}");
    drop(stream);
    eventually("the decode worker cancelling the abandoned request", || {
        metric(metrics, DECODE_REQUESTS, &cancelled).is_ok_and(|n| n == before + 1.0)
    })
    .await?;
    let a = bounded("the queued request", queued).await???.map_err(|s| format!("the queued request: {s:?}"))?;
    assert!(a.done.is_some(), "the queued request ran once the abandoned one was dropped: {a:?}");

    Ok(())
}

/// A deadline that cannot be met.
async fn deadline(cx: Arc<Cx>) -> TestResult {
    let client = cx.client.clone();
    // A deadline that cannot be met: DEADLINE_EXCEEDED, not a hung call.
    let slow = GenerateRequest { ignore_eos: true, ..prompt_req("Once upon a time", 200) };
    let r = generate(&client, slow, Some(Duration::from_millis(50))).await?;
    refused(r, Code::DeadlineExceeded, Some("deadline_exceeded"), None)?;

    Ok(())
}

/// SIGTERM drains the coordinator.
async fn drain(
    cx: Arc<Cx>,
    coord: common::Proc,
    mut watch: tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
) -> TestResult {
    let client = cx.client.clone();
    let prompt = PROMPT;
    // SIGTERM drains: health turns NOT_SERVING and the watch ends (it must
    // not hold the drain), the request in flight still ends with Done, and
    // the coordinator exits 0 well inside its grace.
    let mut first = client.clone();
    let draining = GenerateRequest { ignore_eos: true, ..prompt_req(prompt, 24) };
    let mut stream = bounded("the draining request starting", first.generate(draining)).await??.into_inner();
    bounded("the draining request's first chunk", stream.message()).await??.ok_or("it ended at once")?;
    let signalled = std::time::Instant::now();
    coord.signal(Signal::Term)?;
    let saw_not_serving = bounded("the health watch ending on SIGTERM", async {
        let mut seen = false;
        while let Some(r) = watch.message().await? {
            seen |= r.status == ServingStatus::NotServing as i32;
        }
        Ok::<_, Status>(seen)
    })
    .await??;
    assert!(saw_not_serving, "the watch ended without NOT_SERVING");
    let mut done = None;
    while let Some(m) = bounded("the draining request's next event", stream.message()).await?? {
        if let Some(generate_response::Event::Done(d)) = m.event {
            done = Some(d);
        }
    }
    assert!(done.is_some(), "the request in flight finished during the drain");
    let mut coord = coord;
    let mut exit = None;
    eventually("the coordinator exiting after SIGTERM", || {
        exit = coord.exited();
        exit.is_some()
    })
    .await?;
    assert!(exit.is_some_and(|s| s.success()), "{exit:?}");
    assert!(signalled.elapsed() < Duration::from_secs(30), "the drain took {:?} (grace 60 s)", signalled.elapsed());
    Ok(())
}
