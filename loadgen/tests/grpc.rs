//! The generator's gRPC client ([`loadgen::Api::Grpc`]) against a small in-process
//! tonic server that fakes tandem's `Frontend`: a stream cut twice and resumed from its
//! cursors, a typed refusal, a stream that closes without `Done`, and what each call
//! carried (key, cursor, API key, deadline).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;

use loadgen::{Api, Arrival, Outcome, Plan, PromptSource};
use proto::frontend::v1::frontend_server::{Frontend, FrontendServer};
use proto::frontend::v1::generate_request::Input;
use proto::frontend::v1::generate_response::Event;
use proto::frontend::v1::{
    Chunk, Done, FinishReason, GenerateRequest, GenerateResponse, ListModelsRequest, ListModelsResponse, Usage,
};
use tonic::metadata::MetadataValue;
use tonic::{Request, Response, Status};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;
type Stream = Pin<Box<dyn tokio_stream::Stream<Item = Result<GenerateResponse, Status>> + Send>>;

/// What one call carried: its key, its cursor, its `authorization` and `grpc-timeout`.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    key: String,
    cursor: String,
    auth: String,
    /// `grpc-timeout` in milliseconds.
    timeout_ms: Option<u64>,
}

/// A `grpc-timeout` value (digits and a unit, H M S m u n) in whole milliseconds.
fn grpc_timeout_ms(v: &str) -> Option<u64> {
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => n * 3_600_000,
        "M" => n * 60_000,
        "S" => n * 1_000,
        "m" => n,
        "u" => n / 1_000,
        "n" => n / 1_000_000,
        _ => return None,
    })
}

static SEEN: Mutex<Vec<Seen>> = Mutex::new(Vec::new());
/// Calls of the `busy-twice` prompt so far.
static BUSY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

struct Fake;

fn chunk(text: &str, tokens: u32) -> Result<GenerateResponse, Status> {
    let c = Chunk { text: text.into(), cursor: format!("{tokens}-00000000000000ab"), ..Chunk::default() };
    Ok(GenerateResponse { event: Some(Event::Chunk(c)) })
}

fn typed(mut s: Status, code: &'static str) -> Result<GenerateResponse, Status> {
    s.metadata_mut().insert("x-tandem-error-code", MetadataValue::from_static(code));
    Err(s)
}

#[tonic::async_trait]
impl Frontend for Fake {
    type GenerateStream = Stream;

    /// `cut`: four tokens, a–d. From the start the connection "breaks" after two (a
    /// status naming no error code); from cursor 2 the coordinator hands off after one
    /// more (`coordinator_draining`); from cursor 3 the last token and Done. `busy`: a
    /// typed refusal. `closed`: one token, then the stream closes without Done. `stall`:
    /// never answered.
    async fn generate(&self, request: Request<GenerateRequest>) -> Result<Response<Stream>, Status> {
        let md = |k: &str| request.metadata().get(k).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let auth = md("authorization").unwrap_or_default();
        let timeout_ms = md("grpc-timeout").as_deref().and_then(grpc_timeout_ms);
        let req = request.into_inner();
        let Some(Input::Prompt(prompt)) = req.input else { return Err(Status::invalid_argument("prompt")) };
        let items: Vec<Result<GenerateResponse, Status>> = match prompt.as_str() {
            "cut" => {
                let seen = Seen { key: req.idempotency_key, cursor: req.resume_cursor.clone(), auth, timeout_ms };
                SEEN.lock().unwrap_or_else(|e| e.into_inner()).push(seen);
                match req.resume_cursor.split('-').next() {
                    Some("") => vec![chunk("a", 1), chunk("b", 2), Err(Status::unknown("h2 protocol error: reset"))],
                    Some("2") => vec![chunk("c", 3), typed(Status::unavailable("draining"), "coordinator_draining")],
                    Some("3") => {
                        let usage =
                            Usage { prompt_tokens: 5, completion_tokens: 4, total_tokens: 9, ..Usage::default() };
                        let done = Done {
                            finish_reason: FinishReason::Length as i32,
                            usage: Some(usage),
                            cursor: "4-00000000000000ab.1".into(),
                            ..Done::default()
                        };
                        vec![chunk("d", 4), Ok(GenerateResponse { event: Some(Event::Done(done)) })]
                    }
                    _ => vec![typed(Status::failed_precondition("resume_mismatch"), "resume_mismatch")],
                }
            }
            "busy" => vec![typed(Status::resource_exhausted("over the tenant's rate"), "rate_limited")],
            "busy-twice" => {
                // Refused twice (with `retry-after: 1`), then answered.
                if BUSY.fetch_add(1, std::sync::atomic::Ordering::SeqCst) < 2 {
                    let mut s = Status::unavailable("no worker can take it now");
                    s.metadata_mut().insert("retry-after", MetadataValue::from_static("1"));
                    vec![typed(s, "no_worker")]
                } else {
                    let done = Done { finish_reason: FinishReason::Stop as i32, ..Done::default() };
                    vec![chunk("ok", 1), Ok(GenerateResponse { event: Some(Event::Done(done)) })]
                }
            }
            "stall" => {
                // No answer at all, as a resumed call's headers wait for the regenerated
                // answer to reach its cursor: the call's deadline is all that ends it.
                std::future::pending::<()>().await;
                vec![]
            }
            _ => vec![chunk("x", 1)],
        };
        Ok(Response::new(Box::pin(tokio_stream::iter(items)) as Stream))
    }

    async fn list_models(&self, _: Request<ListModelsRequest>) -> Result<Response<ListModelsResponse>, Status> {
        Ok(Response::new(ListModelsResponse::default()))
    }
}

async fn fake_frontend() -> Result<String, std::io::Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(FrontendServer::new(Fake))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    Ok(format!("http://{addr}"))
}

fn plan(url: &str, prompt: &str) -> Plan {
    let mut p = Plan::new(url, "m");
    p.api = Api::Grpc;
    p.requests = 1;
    p.arrival = Arrival::Closed { concurrency: 1 };
    p.prompts = PromptSource::List(vec![prompt.into()]);
    p.timeout = Duration::from_secs(20);
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_streams_resume_from_their_cursor_and_failures_keep_their_code() -> TestResult {
    let url = fake_frontend().await?;
    let mut p = plan(&url, "cut");
    p.resume = true;
    p.api_key = Some("sk-7".into());
    p.deadline = Some(Duration::from_secs(9));
    let r = loadgen::run(&p).await?;
    let rec = &r.records[0];
    assert_eq!(rec.outcome, Outcome::Complete { finish_reason: "length".into() }, "{rec:?}");
    assert_eq!((rec.text.as_str(), rec.output_tokens, rec.prompt_tokens), ("abcd", 4, Some(5)), "{rec:?}");
    assert_eq!((rec.retries.resumed, rec.retries.regenerated), (2, 2 + 3), "{rec:?}");
    assert!(rec.ttft.is_some() && rec.itl.len() == 3, "every token timed across the resumes: {rec:?}");
    assert!(
        rec.cuts.len() == 2 && rec.cuts[0].contains("reset") && rec.cuts[1].contains("coordinator_draining"),
        "each cut noted with its outcome: {:?}",
        rec.cuts
    );
    let seen = std::mem::take(&mut *SEEN.lock().unwrap_or_else(|e| e.into_inner()));
    let cursors: Vec<&str> = seen.iter().map(|s| s.cursor.as_str()).collect();
    assert_eq!(cursors, ["", "2-00000000000000ab", "3-00000000000000ab"]);
    assert!(
        seen.iter().all(|s| !s.key.is_empty() && s.key == seen[0].key && s.auth == "Bearer sk-7"),
        "one key and the API key on every call: {seen:?}"
    );
    // The deadline on every call: the whole one first, then what is left of it (each
    // resume pauses 50 ms or more first).
    let left: Vec<u64> = seen.iter().filter_map(|s| s.timeout_ms).collect();
    assert!(left.len() == 3 && left[0] <= 9_000 && left[0] > 8_000, "{seen:?}");
    assert!(left.windows(2).all(|w| w[1] + 50 <= w[0]), "each call has less left: {seen:?}");

    // Not resuming: the broken connection is the outcome, with no code.
    let r = loadgen::run(&plan(&url, "cut")).await?;
    let rec = &r.records[0];
    assert!(matches!(&rec.outcome, Outcome::Transport(m) if m.contains("reset")), "{rec:?}");
    assert_eq!((rec.text.as_str(), rec.outcome.error_code()), ("ab", None));
    SEEN.lock().unwrap_or_else(|e| e.into_inner()).clear();

    // A typed refusal keeps its code and is not resumed; a stream without Done is no answer.
    let mut p = plan(&url, "busy");
    p.resume = true;
    let rec = &loadgen::run(&p).await?.records[0];
    assert_eq!(rec.outcome.label(), "grpc ResourceExhausted rate_limited", "{rec:?}");
    assert_eq!(rec.retries.resumed, 0);
    let rec = &loadgen::run(&plan(&url, "closed")).await?.records[0];
    assert!(matches!(rec.outcome, Outcome::Protocol(_)), "{rec:?}");
    Ok(())
}

/// A retrying gRPC client waits out a refusal's `retry-after` and calls again, as an
/// HTTP one does; without a retry policy the refusal is the outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_refusals_are_retried_after_their_retry_after() -> TestResult {
    let url = fake_frontend().await?;
    let mut p = plan(&url, "busy-twice");
    p.retry = Some(loadgen::Retry { max: 3, eager_every: 0, eager_delay: Duration::ZERO });
    let rec = &loadgen::run(&p).await?.records[0];
    assert_eq!(rec.outcome, Outcome::Complete { finish_reason: "stop".into() }, "{rec:?}");
    assert_eq!(rec.retries.sent, 2, "{rec:?}");
    assert!(rec.e2e >= Duration::from_secs(2), "each retry waited its second: {rec:?}");
    assert!(rec.retries.last_start.is_some_and(|s| s >= Duration::from_secs(2)), "{rec:?}");

    BUSY.store(0, std::sync::atomic::Ordering::SeqCst);
    let rec = &loadgen::run(&plan(&url, "busy-twice")).await?.records[0];
    assert_eq!(rec.outcome.label(), "grpc Unavailable no_worker", "{rec:?}");
    assert_eq!(rec.retries.sent, 0);
    Ok(())
}

/// A call unanswered at its deadline ends there, typed, on the client's own timer
/// (tonic's channel enforces `grpc-timeout` until the answer's headers): a resuming
/// client does not take the channel's expiry for a cut stream and call again with
/// nothing left until it gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_grpc_stream_fails_typed_at_its_deadline_and_is_not_resumed() -> TestResult {
    let url = fake_frontend().await?;
    let mut p = plan(&url, "stall");
    p.resume = true;
    p.deadline = Some(Duration::from_millis(300));
    let rec = &loadgen::run(&p).await?.records[0];
    assert_eq!(rec.outcome.label(), "grpc DeadlineExceeded deadline_exceeded", "{rec:?}");
    assert_eq!(rec.retries.resumed, 0, "{rec:?}");
    assert!(rec.cuts.is_empty(), "{rec:?}");
    Ok(())
}
