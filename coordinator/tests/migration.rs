//! Exact continuation and request migration, through real processes.
//!
//! - A seeded answer is the same token for token (ids through their vocabulary
//!   pieces, logprobs to the bit) prefilled remotely, prefilled locally, and from
//!   `tandem generate` alone, greedy and sampled with penalties, over 200 tokens;
//!   an unseeded request is told its seed, and that seed reproduces it.
//! - Eight streams of 200 tokens, half sampled at temperature 0.8, lose their
//!   decode worker to a SIGKILL before their first token, mid-stream, and while
//!   the coordinator holds text back for a stop string, then to a SIGSTOP: every
//!   stream completes, with no error event, token for token the undisturbed
//!   answer; the moves are counted, and no KV block is left held anywhere.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "bounds on real time while real processes run")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use facts::metrics::coordinator::{DECODE_REROUTES, MIGRATIONS};
use facts::metrics::decode::{PREFILL_ROUTE, RESERVATIONS_ACTIVE};
use facts::metrics::worker::{KV_BLOCKS_USED, REQUESTS_RUNNING};
use serde_json::{json, Value};

/// A worker's flags: registered in etcd under `prefix` as `id`, one compute thread.
fn worker(ep: &str, prefix: &str, id: &str) -> Vec<String> {
    ["--etcd", ep, "--cluster-prefix", prefix, "--lease-ttl-s", "2", "--version-group", "g1", "--worker-id", id]
        .iter()
        .map(|s| (*s).to_owned())
        .chain(["--threads", "1", "--kv-blocks", "512"].map(str::to_owned))
        .collect()
}

fn start_owned(bin: &str, args: &[String], wants: &[&str]) -> opskit::Result<Proc> {
    start(bin, &args.iter().map(String::as_str).collect::<Vec<_>>(), wants)
}

/// A coordinator routing from etcd under `prefix`; prompts of at most `local_max` tokens
/// are prefilled on the decode worker.
fn coordinator(ep: &str, prefix: &str, local_max: usize, extra: &[&str]) -> opskit::Result<Proc> {
    let local = local_max.to_string();
    let mut args = vec!["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--etcd", ep, "--cluster-prefix", prefix];
    args.extend(["--local-prefill-max-tokens", &local, "--load-poll-ms", "100"]);
    args.extend_from_slice(extra);
    start("tandem-coordinator", &args, &["http"])
}

/// Waits until the coordinator at `h` counts `n` serving decode workers whose load it knows.
async fn decode_serving(h: &str, n: f64) -> TestResult {
    use facts::metrics::coordinator::{WORKERS, WORKERS_LOAD_KNOWN};
    eventually(&format!("{n} decode workers serving with known load"), || {
        metric(h, WORKERS, &[("role", "decode"), ("state", "serving")]).is_ok_and(|v| v == n)
            && metric(h, WORKERS_LOAD_KNOWN, &[("role", "decode")]).is_ok_and(|v| v == n)
    })
    .await
}

/// One generated token as the API shows it: its vocabulary piece and its logprob.
type Token = (String, f64);

/// The tokens of a completions answer or event (`logprobs.content`).
fn tokens_of(v: &Value) -> Vec<Token> {
    v["choices"][0]["logprobs"]["content"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|t| {
                    (t["token"].as_str().unwrap_or_default().to_owned(), t["logprob"].as_f64().unwrap_or(f64::NAN))
                })
                .collect()
        })
        .unwrap_or_default()
}

const PROMPT: &str = "Once upon a time, in a village by the sea, there lived an old fisherman who";

/// The request body: 200 tokens, each with its logprob.
fn body(prompt: &str, sampled: Option<u64>, stream: bool) -> Value {
    let mut b = json!({
        "model": MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": true, "logprobs": 0, "stream": stream,
        "temperature": 0,
    });
    if let Some(seed) = sampled {
        b["temperature"] = json!(0.8);
        b["top_p"] = json!(0.95);
        b["presence_penalty"] = json!(0.3);
        b["frequency_penalty"] = json!(0.2);
        b["seed"] = json!(seed);
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_answers_are_equal_prefilled_remotely_locally_and_alone() -> TestResult {
    let etcd = opskit::etcd::Etcd::start().await?;
    let ep = etcd.endpoint();
    let _p = start_owned("tandem-prefill-worker", &worker(&ep, "seeded", "p1"), &["grpc"])?;
    let mut dargs = worker(&ep, "seeded", "d1");
    dargs.extend(["--kv-load-failure-policy", "fail"].map(str::to_owned));
    let d = start_owned("tandem-decode-worker", &dargs, &["grpc", "metrics"])?;
    let remote = coordinator(&ep, "seeded", 0, &[])?;
    let local = coordinator(&ep, "seeded", 1_000_000, &[])?;
    let (hr, hl) = (remote.addr("http")?, local.addr("http")?);
    decode_serving(&hr, 1.0).await?;
    decode_serving(&hl, 1.0).await?;
    let dm = d.addr("metrics")?;
    let routed = |route| metric(&dm, PREFILL_ROUTE, &[("route", route)]);
    let (remote0, local0) = (routed("remote")?, routed("local")?);

    let tandem = opskit::process::bin("tandem")?;
    for (name, sampled) in [("greedy", None), ("sampled", Some(0x5eed_u64))] {
        let mut answers = Vec::new();
        for h in [&hr, &hl] {
            let (s, headers, text) = post(h, "/v1/completions", &body(PROMPT, sampled, false))?;
            assert_eq!(s, 200, "{text}");
            if let Some(seed) = sampled {
                let returned = headers.get("x-tandem-seed").and_then(|v| v.to_str().ok()).map(str::to_owned);
                assert_eq!(returned, Some(seed.to_string()), "the request's own seed is returned");
            }
            let v = json_of(&text)?;
            assert!(v["system_fingerprint"].as_str().is_some_and(|f| f.len() == 64), "{}", v["system_fingerprint"]);
            answers.push(tokens_of(&v));
        }
        assert_eq!(answers[0].len(), 200, "{name}");
        assert_eq!(answers[0], answers[1], "{name}: remote and local prefill give the same tokens and logprobs");
        // The engine alone, in `tandem generate`.
        let mut cmd = std::process::Command::new(&tandem);
        cmd.args(["generate", "--prompt", PROMPT, "--max-tokens", "200", "--ignore-eos", "--tokens", "--threads", "1"]);
        if let Some(seed) = sampled {
            let seed = seed.to_string();
            cmd.args(["--temperature", "0.8", "--top-p", "0.95", "--seed", &seed]);
            cmd.args(["--presence-penalty", "0.3", "--frequency-penalty", "0.2"]);
        }
        let out = cmd.output()?;
        assert!(out.status.success(), "tandem generate: {}", String::from_utf8_lossy(&out.stderr));
        let alone: Vec<Token> = String::from_utf8(out.stdout)?
            .lines()
            .map(|l| {
                let v: Value = serde_json::from_str(l).expect("a JSON line");
                (v["token"].as_str().unwrap_or_default().to_owned(), v["logprob"].as_f64().unwrap_or(f64::NAN))
            })
            .collect();
        assert_eq!(alone, answers[0], "{name}: the cluster's answer is `tandem generate`'s");
    }
    assert_eq!((routed("remote")? - remote0, routed("local")? - local0), (2.0, 2.0), "each path taken twice");

    // An unseeded request gets a seed, and that seed gives the same answer again.
    let mut unseeded = body(PROMPT, Some(0), false);
    unseeded.as_object_mut().map(|o| o.remove("seed"));
    let (s, headers, text) = post(&hr, "/v1/completions", &unseeded)?;
    assert_eq!(s, 200, "{text}");
    let seed: u64 = headers.get("x-tandem-seed").and_then(|v| v.to_str().ok()).ok_or("no x-tandem-seed")?.parse()?;
    let (s, _, again) = post(&hl, "/v1/completions", &body(PROMPT, Some(seed), false))?;
    assert_eq!(s, 200, "{again}");
    assert_eq!(tokens_of(&json_of(&text)?), tokens_of(&json_of(&again)?), "the returned seed reproduces the answer");
    Ok(())
}

/// One stream's record, filled by its reader thread.
#[derive(Default, Clone)]
struct Seen {
    tokens: Vec<Token>,
    text: String,
    /// Events that carried a token but no text: the coordinator held it back (a possible stop string).
    held: usize,
    done: bool,
    /// A typed error event, or a transport failure.
    error: Option<String>,
}

/// Eight streams of `body`s, each read to its end on a thread of its own.
struct Load {
    seen: Vec<Arc<Mutex<Seen>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(h: &str, bodies: &[Value]) -> Self {
        let mut seen = Vec::new();
        let mut readers = Vec::new();
        for b in bodies {
            let s = Arc::new(Mutex::new(Seen::default()));
            let (h, b, rec) = (h.to_owned(), b.clone(), s.clone());
            readers.push(std::thread::spawn(move || {
                let fail = |e: String| rec.lock().unwrap().error = Some(e);
                let mut stream = match open_stream(&h, "/v1/completions", &b, &[]) {
                    Ok(s) if s.status == 200 => s,
                    Ok(s) => {
                        let status = s.status;
                        return fail(format!("status {status}: {}", s.text().unwrap_or_else(|e| e.to_string())));
                    }
                    Err(e) => return fail(e.to_string()),
                };
                loop {
                    match stream.next_event() {
                        Ok(Some(e)) if e == "[DONE]" => {
                            rec.lock().unwrap().done = true;
                            return;
                        }
                        Ok(Some(e)) => {
                            let v: Value = serde_json::from_str(&e).unwrap_or_default();
                            if v.get("error").is_some() {
                                return fail(e);
                            }
                            let mut r = rec.lock().unwrap();
                            let text = v["choices"][0]["text"].as_str().unwrap_or_default();
                            let t = tokens_of(&v);
                            if text.is_empty() && !t.is_empty() {
                                r.held += 1;
                            }
                            r.text.push_str(text);
                            r.tokens.extend(t);
                        }
                        Ok(None) => return fail("the stream ended without [DONE]".into()),
                        Err(e) => return fail(e.to_string()),
                    }
                }
            }));
            seen.push(s);
        }
        Self { seen, readers }
    }

    fn snapshot(&self) -> Vec<Seen> {
        self.seen.iter().map(|s| s.lock().unwrap().clone()).collect()
    }

    fn finish(self) -> Vec<Seen> {
        for r in self.readers {
            r.join().expect("reader thread");
        }
        self.seen.iter().map(|s| s.lock().unwrap().clone()).collect()
    }
}

/// Every stream completed without an error, with the undisturbed tokens and text.
fn all_exact(what: &str, got: &[Seen], want: &[Seen]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.done && g.error.is_none(), "{what}: stream {i} did not complete: {:?}", g.error);
        assert_eq!(g.tokens.len(), 200, "{what}: stream {i}");
        assert_eq!(g.tokens, w.tokens, "{what}: stream {i}'s tokens differ from the undisturbed run");
        assert_eq!(g.text, w.text, "{what}: stream {i}'s text differs from the undisturbed run");
    }
}

fn count(h: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_sum(h, name, labels).unwrap_or(f64::NAN)
}

/// No KV held anywhere once the streams are over.
async fn kv_settled(workers: &[&Proc]) -> TestResult {
    for w in workers {
        let m = w.addr("metrics")?;
        let decode = w.name == "tandem-decode-worker";
        eventually(&format!("{} (pid {}): KV back to 0", w.name, w.pid), || {
            metric(&m, KV_BLOCKS_USED, &[]).is_ok_and(|v| v == 0.0)
                && (!decode || metric(&m, RESERVATIONS_ACTIVE, &[]).is_ok_and(|v| v == 0.0))
        })
        .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_outlive_a_killed_or_frozen_decode_worker_token_for_token() -> TestResult {
    let etcd = opskit::etcd::Etcd::start().await?;
    let ep = etcd.endpoint();
    let p = start_owned("tandem-prefill-worker", &worker(&ep, "moves", "p1"), &["grpc", "metrics"])?;
    let dargs = |id| {
        let mut a = worker(&ep, "moves", id);
        a.extend(["--kv-load-failure-policy", "recompute"].map(str::to_owned));
        a
    };
    let mut d = [
        start_owned("tandem-decode-worker", &dargs("d1"), &["grpc", "metrics"])?,
        start_owned("tandem-decode-worker", &dargs("d2"), &["grpc", "metrics"])?,
    ];
    let coord = coordinator(&ep, "moves", 0, &["--migration-stall-ms", "1500"])?;
    let h = coord.addr("http")?;
    decode_serving(&h, 2.0).await?;

    let prompts: Vec<String> = (0..8).map(|i| format!("Tale {i}. {PROMPT}")).collect();
    let plain: Vec<Value> =
        prompts.iter().enumerate().map(|(i, p)| body(p, (i % 2 == 1).then_some(100 + i as u64), true)).collect();
    let undisturbed = Load::start(&h, &plain).finish();
    for (i, s) in undisturbed.iter().enumerate() {
        assert!(s.done && s.error.is_none() && s.tokens.len() == 200, "undisturbed stream {i}: {:?}", s.error);
    }
    let victim_moves = |labels: &[(&str, &str)]| count(&h, MIGRATIONS, labels);

    // 1. SIGKILL before any token: the prefill worker is frozen for the moment, so the
    //    requests wait on the decode workers for their KV and no token exists yet. Those
    //    on the victim, the worker holding more, are routed again; then the prefill
    //    worker thaws and every request runs.
    let received = |w: &Proc| {
        metric_sum(&w.addr("metrics").unwrap_or_default(), facts::metrics::worker::REQUESTS_BY_PRIORITY, &[])
            .unwrap_or(0.0)
    };
    let r0 = [received(&d[0]), received(&d[1])];
    let moved_before = victim_moves(&[("outcome", "ok")]) + count(&h, DECODE_REROUTES, &[]);
    p.signal(Signal::Stop)?;
    let load = Load::start(&h, &plain);
    eventually("all eight requests reached a decode worker", || {
        received(&d[0]) - r0[0] + received(&d[1]) - r0[1] >= 8.0
    })
    .await?;
    let on_first = received(&d[0]) - r0[0];
    let (v, on_victim) = if on_first >= 4.0 { (0, on_first) } else { (1, 8.0 - on_first) };
    assert!(load.snapshot().iter().all(|s| s.tokens.is_empty()), "the kill came after a token");
    d[v].signal(Signal::Kill)?;
    p.signal(Signal::Cont)?;
    all_exact("killed before a token", &load.finish(), &undisturbed);
    let moved = victim_moves(&[("outcome", "ok")]) + count(&h, DECODE_REROUTES, &[]) - moved_before;
    assert!(moved >= on_victim, "{moved} moves for the victim's {on_victim} requests");
    // Back to two decode workers: the victim starts again under its own id.
    d[v] = start_owned("tandem-decode-worker", &dargs(["d1", "d2"][v]), &["grpc", "metrics"])?;
    decode_serving(&h, 2.0).await?;
    let [mut d1, d2] = d;

    // The next scenarios put all eight streams on d1: d2 is frozen (stale: routed
    // nothing) while they start, then thawed, so the streams have somewhere to move.
    let all_on_d1 = |bodies: &[Value]| -> Result<Load, Box<dyn std::error::Error + Send + Sync>> {
        opskit::process::signal(d2.pid, Signal::Stop)?;
        let stale_wait = std::time::Instant::now();
        while count(&h, facts::metrics::coordinator::WORKERS_STALE, &[("role", "decode")]) < 1.0 {
            assert!(stale_wait.elapsed() < WAIT, "d2 never went stale");
            std::thread::sleep(Duration::from_millis(50));
        }
        let load = Load::start(&h, bodies);
        let begin = std::time::Instant::now();
        while !load.snapshot().iter().all(|s| !s.tokens.is_empty()) {
            assert!(begin.elapsed() < WAIT, "the streams never started");
            std::thread::sleep(Duration::from_millis(20));
        }
        opskit::process::signal(d2.pid, Signal::Cont)?;
        Ok(load)
    };
    let on = |w: &Proc| metric(&w.addr("metrics").unwrap_or_default(), REQUESTS_RUNNING, &[]).unwrap_or(0.0);

    // 2. SIGKILL mid-stream.
    let load = all_on_d1(&plain)?;
    decode_serving(&h, 2.0).await?;
    let begin = std::time::Instant::now();
    while load.snapshot().iter().map(|s| s.tokens.len()).min().unwrap_or(0) < 20 {
        assert!(begin.elapsed() < WAIT, "the streams stalled");
        std::thread::sleep(Duration::from_millis(20));
    }
    let (running, before) = (on(&d1), victim_moves(&[("reason", "worker_lost"), ("outcome", "ok")]));
    assert_eq!(running, 8.0, "all eight run on d1");
    d1.signal(Signal::Kill)?;
    all_exact("killed mid-stream", &load.finish(), &undisturbed);
    let moved = victim_moves(&[("reason", "worker_lost"), ("outcome", "ok")]) - before;
    assert!(moved >= 8.0, "{moved} moves for the victim's 8 streams");
    d1 = start_owned("tandem-decode-worker", &dargs("d1"), &["grpc", "metrics"])?;
    decode_serving(&h, 2.0).await?;

    // 3. SIGKILL while text is held back for a stop string: each request stops at a
    //    string its answer never completes (a run of its own text, then a BEL), so the
    //    coordinator holds the run's text back until the mismatch, and the answer is the
    //    undisturbed one.
    let stopped: Vec<Value> = plain
        .iter()
        .zip(&undisturbed)
        .map(|(b, u)| {
            let chars: Vec<char> = u.text.chars().collect();
            let at = chars.len() / 3;
            let run: String = chars[at..(at + 12).min(chars.len())].iter().collect();
            let mut b = b.clone();
            b["stop"] = json!([format!("{run}\u{7}")]);
            b
        })
        .collect();
    let load = all_on_d1(&stopped)?;
    decode_serving(&h, 2.0).await?;
    let begin = std::time::Instant::now();
    while load.snapshot().iter().all(|s| s.held == 0 || s.tokens.len() < 5) {
        assert!(begin.elapsed() < WAIT, "no text was held back");
        std::thread::sleep(Duration::from_millis(5));
    }
    let before = victim_moves(&[("reason", "worker_lost"), ("outcome", "ok")]);
    d1.signal(Signal::Kill)?;
    all_exact("killed inside a held-back stop string", &load.finish(), &undisturbed);
    assert!(victim_moves(&[("reason", "worker_lost"), ("outcome", "ok")]) - before >= 8.0);
    d1 = start_owned("tandem-decode-worker", &dargs("d1"), &["grpc", "metrics"])?;
    decode_serving(&h, 2.0).await?;

    // 4. SIGSTOP mid-stream: no token, and the worker's load reports go stale: the
    //    streams move; thawed, the old worker drops what it held.
    let load = all_on_d1(&plain)?;
    decode_serving(&h, 2.0).await?;
    let begin = std::time::Instant::now();
    while load.snapshot().iter().map(|s| s.tokens.len()).min().unwrap_or(0) < 20 {
        assert!(begin.elapsed() < WAIT, "the streams stalled");
        std::thread::sleep(Duration::from_millis(20));
    }
    let before = victim_moves(&[("reason", "stalled"), ("outcome", "ok")]);
    d1.signal(Signal::Stop)?;
    all_exact("frozen mid-stream", &load.finish(), &undisturbed);
    assert!(
        victim_moves(&[("reason", "stalled"), ("outcome", "ok")]) - before >= 8.0,
        "the frozen worker's streams moved"
    );
    d1.signal(Signal::Cont)?;
    kv_settled(&[&d1, &d2, &p]).await?;
    Ok(())
}
