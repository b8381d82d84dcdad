//! What the coordinator's process tests share beyond opskit (the workspace's one harness:
//! HTTP client, metric pages, process starter, waits): a worker pair or an etcd-routed
//! coordinator to test against, the single-process engine's reference output, the OpenAI
//! error shape, and opskit's calls with these tests' bound and shapes.

#![allow(dead_code, unused_imports)]

use std::time::Duration;

use engine::batch::{Engine, EngineConfig, Request};
use engine::model::Model;
use engine::tokenizer::Tokenizer;
use engine::weights::Weights;
pub use opskit::http::blocking::EventStream;
pub use opskit::http::HeaderMap;
pub use opskit::process::{Launch, Proc, Signal};
use serde_json::Value;
use types::sampling::SamplingParams;

pub type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

pub const WAIT: Duration = Duration::from_secs(120);
pub const MODEL: &str = "SmolLM2-135M-Instruct";

/// Starts workspace binary `name` with `args` and waits until it printed `listening` lines
/// for `wants` (its stderr goes to a log file whose tail a failing test prints).
pub fn start(name: &str, args: &[&str], wants: &[&str]) -> opskit::Result<Proc> {
    Launch::bin(name).args(args).wants(wants).wait(WAIT).start_blocking()
}

/// One exchange: (status, headers, body as text).
pub fn http(
    addr: &str,
    method: &str,
    path: &str,
    content_type: &str,
    body: &[u8],
    extra: &[(&str, &str)],
) -> opskit::Result<(u16, HeaderMap, String)> {
    let mut req = opskit::http::Request::new(method, addr, path).body(content_type, body).timeout(WAIT);
    for (k, v) in extra {
        req = req.header(k, v);
    }
    let r = req.send_blocking()?;
    let text = r.text();
    Ok((r.status, r.headers, text))
}

/// `POST path` with a JSON body: (status, headers, body as text).
pub fn post(addr: &str, path: &str, v: &Value) -> opskit::Result<(u16, HeaderMap, String)> {
    http(addr, "POST", path, "application/json", v.to_string().as_bytes(), &[])
}

/// Posts `body` to `path` (with `extra` headers) and returns once the answer's head is read;
/// dropping the stream closes the connection (the client going away).
pub fn open_stream(addr: &str, path: &str, body: &Value, extra: &[(&str, &str)]) -> opskit::Result<EventStream> {
    let mut req = opskit::http::Request::post(addr, path).json(body).timeout(WAIT);
    for (k, v) in extra {
        req = req.header(k, v);
    }
    req.stream_blocking()
}

pub fn json_of(body: &str) -> Result<Value, String> {
    serde_json::from_str(body).map_err(|e| format!("{e}: {body}"))
}

/// A `user` value no other request of this process has: a request sent again after a
/// refusal is a retry to the coordinator's gate (known by its body) unless something in it
/// differs, and these tests send new requests, not retries.
pub fn unique() -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    format!("test-{}", N.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
}

/// The series `name{labels}` on `addr`'s `/metrics`; an error when the page lacks it.
pub fn metric(addr: &str, name: &str, labels: &[(&str, &str)]) -> opskit::Result<f64> {
    opskit::prom::scrape_blocking(addr)?.get(name, labels)
}

/// The sum of the series of `name` matching `labels` on `addr`'s `/metrics`; an error when
/// none does.
pub fn metric_sum(addr: &str, name: &str, labels: &[(&str, &str)]) -> opskit::Result<f64> {
    opskit::prom::scrape_blocking(addr)?.sum(name, labels)
}

/// A labelled counter before it may have been incremented (it is rendered from its first
/// increment, so none yet reads 0). The test must then wait for it with [`metric`], which a
/// renamed counter fails.
pub fn counter_before(addr: &str, name: &str, labels: &[(&str, &str)]) -> opskit::Result<f64> {
    Ok(opskit::prom::scrape_blocking(addr)?.absent_as_zero(name, labels))
}

/// Polls the synchronous check `f` until it holds (bounded by [`WAIT`]); the error says what
/// did not happen.
pub async fn eventually(what: &str, mut f: impl FnMut() -> bool) -> TestResult {
    Ok(opskit::eventually(what, WAIT, || std::future::ready(f())).await?)
}

/// Greedy continuation of `ids` from the single-process engine, as text.
pub fn reference(tok: &Tokenizer, ids: &[u32], max_tokens: u32) -> Result<String, String> {
    let path = engine::paths::default_model_path();
    let (w, _) = Weights::from_gguf(&path).map_err(|e| e.to_string())?;
    let model = Model::new(w, 2).map_err(|e| e.to_string())?;
    let mut e = Engine::new(model, EngineConfig::default(), tok.eos_ids().to_vec()).map_err(|e| e.to_string())?;
    let params = SamplingParams { max_tokens, ..SamplingParams::default() };
    e.add(Request {
        id: 1,
        prompt: ids.to_vec(),
        params,
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    while e.has_work() {
        for ev in e.step().map_err(|e| e.to_string())? {
            if !tok.eos_ids().contains(&ev.token.id) {
                out.push(ev.token.id);
            }
        }
    }
    tok.decode(&out, true).map_err(|e| e.to_string())
}

pub fn error_of(status: u16, body: &str, want_status: u16, want_param: Option<&str>) -> TestResult {
    assert_eq!(status, want_status, "{body}");
    let v = json_of(body)?;
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    // Every error has a code (README's error table), never null.
    assert!(e["type"].is_string() && e["code"].is_string() && e.get("param").is_some(), "{body}");
    if let Some(p) = want_param {
        assert_eq!(e["param"], p, "{body}");
    }
    Ok(())
}

/// A prefill and a decode worker (version group `g`, one thread each,
/// `kv_blocks` KV blocks, policy `recompute`, every prompt prefilled
/// remotely) and a coordinator in front of them by address, with
/// `coordinator_args` added to its flags.
pub struct Pair {
    pub prefill: Proc,
    pub decode: Proc,
    pub coord: Proc,
}

pub fn start_pair(kv_blocks: &str, coordinator_args: &[&str]) -> opskit::Result<Pair> {
    let common = ["--version-group", "g", "--threads", "1", "--kv-blocks", kv_blocks];
    let prefill = start("tandem-prefill-worker", &common, &["grpc", "metrics"])?;
    let mut dargs = common.to_vec();
    dargs.extend(["--kv-load-failure-policy", "recompute"]);
    let decode = start("tandem-decode-worker", &dargs, &["grpc", "metrics", "transfer"])?;
    let (d, p) = (decode.addr("grpc")?, prefill.addr("grpc")?);
    let mut args = vec!["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--decode", &d, "--prefill", &p];
    args.extend_from_slice(coordinator_args);
    let coord = start("tandem-coordinator", &args, &["http", "grpc"])?;
    Ok(Pair { prefill, decode, coord })
}

/// A coordinator routing from etcd membership under `prefix` (every prompt
/// prefilled remotely), with `extra` flags.
pub fn start_etcd_coordinator(ep: &str, prefix: &str, extra: &[&str]) -> opskit::Result<Proc> {
    let mut args = vec!["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--etcd", ep, "--cluster-prefix", prefix];
    args.extend(["--local-prefill-max-tokens", "0"]);
    args.extend_from_slice(extra);
    start("tandem-coordinator", &args, &["http"])
}

/// A test part's outcome (a part run as a task): an error it returned or an assertion it
/// failed, named, so a scenario test can run every part and report all that failed.
pub fn record(failed: &mut Vec<String>, name: &str, r: Result<TestResult, tokio::task::JoinError>) {
    let why = match r {
        Ok(Ok(())) => return,
        Ok(Err(e)) => e.to_string(),
        Err(e) => match e.try_into_panic() {
            Ok(p) => p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "a panic".into()),
            Err(e) => e.to_string(),
        },
    };
    failed.push(format!("{name}: {why}"));
}
