//! `tandem sim` against a real etcd and a real coordinator: the coordinator finds every
//! simulated worker through etcd, learns their load and prefix reports by polling, routes
//! chat requests to them (remote prefill included) and answers them, sends a repeated
//! prompt where its blocks are held, and sees the workers go when their process dies,
//! answering with a typed refusal rather than hanging.
//!
//! Real processes: etcd, `tandem sim` (5 simulated workers), `tandem-coordinator`.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::path::PathBuf;
use std::time::Duration;

use opskit::etcd::Etcd;
use opskit::process::{Launch, Proc, Signal};
use serde_json::{json, Value};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

const LEASE_TTL_S: u64 = 2;

fn log_dir(name: &str) -> std::io::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The coordinator's count of workers of `role` in `state`.
async fn workers(http: &str, role: &str, state: &str) -> opskit::Result<f64> {
    opskit::prom::scrape(http).await?.get(facts::metrics::coordinator::WORKERS, &[("role", role), ("state", state)])
}

async fn chat(http: &str, content: &str, max_tokens: u32) -> opskit::Result<(u16, Value)> {
    let body = json!({
        "model": "SmolLM2-135M-Instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    });
    let r = opskit::http::Request::post(http, "/v1/chat/completions").json(&body).timeout(Duration::from_secs(30));
    let r = r.send().await?;
    Ok((r.status, r.json()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_serves_from_simulated_workers_and_sees_them_die() -> TestResult {
    let dir = log_dir("tandem-sim-test")?;
    let etcd = Etcd::start().await?;
    let ep = etcd.endpoint();
    let sim = Launch::bin("tandem")
        .name("sim")
        .args(["sim", "--etcd", ep.as_str(), "--decode", "3", "--prefill", "2", "--name", "t"])
        .args(["--lease-ttl-s", &LEASE_TTL_S.to_string(), "--decode-step-us", "1000"])
        .until_line("sim: ")
        .log_dir(&dir)
        .start()
        .await?;
    let args: Vec<String> = ["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--etcd", ep.as_str()]
        .into_iter()
        .chain(["--local-prefill-max-tokens", "32", "--load-poll-ms", "100"])
        .map(str::to_owned)
        .collect();
    let coordinator = Proc::start("coordinator", "tandem-coordinator", &args, &["http", "grpc"], &dir).await?;
    let http = coordinator.addr("http")?;

    opskit::poll(
        "the coordinator serving from 3 decode and 2 prefill simulated workers",
        Duration::from_secs(30),
        || {
            let http = http.clone();
            async move {
                let counted = (workers(&http, "decode", "serving").await?, workers(&http, "prefill", "serving").await?);
                Ok::<_, opskit::Error>((counted == (3.0, 2.0)).then_some(()))
            }
        },
    )
    .await?;

    // Short prompts prefill on the decode worker, long ones on a prefill worker: each
    // answered with the tokens asked for.
    let long =
        "Tell me about the rivers of Europe, their sources, their lengths and the cities on their banks. ".repeat(20);
    for (i, content) in ["hi", long.as_str(), "what is two and two?", long.as_str()].iter().enumerate() {
        let (status, body) = chat(&http, &format!("{i}: {content}"), 6).await?;
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["usage"]["completion_tokens"], 6, "{body}");
        assert!(!body["choices"][0]["message"]["content"].as_str().unwrap_or_default().is_empty(), "{body}");
    }

    // A repeated long prompt: once a poll has carried the blocks the first left (the
    // prefix report), routing expects them cached where it sends the second, and the
    // worker reports them cached in the answer.
    let (status, first) = chat(&http, &long, 4).await?;
    assert_eq!(status, 200, "{first}");
    let expected = facts::metrics::coordinator::PREFIX_CACHED_TOKENS;
    // Every chat prompt shares the template's system prompt (three blocks): routing
    // expects those to hit already.
    let before = opskit::prom::scrape(&http).await?.absent_as_zero(expected, &[]);
    let cached = opskit::poll("a repeated prompt routed to its cached blocks", Duration::from_secs(10), || {
        let (http, long) = (http.clone(), long.clone());
        async move {
            let (status, body) = chat(&http, &long, 4).await?;
            let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0);
            Ok::<_, opskit::Error>((status == 200 && cached >= 256).then_some(cached))
        }
    })
    .await?;
    assert!(cached <= first["usage"]["prompt_tokens"].as_u64().unwrap_or(0), "{cached} cached of {first}");
    let after = opskit::prom::scrape(&http).await?.sum(expected, &[])?;
    assert!(after - before >= 256.0, "routing expected the hit from the workers' prefix reports: {before} -> {after}");

    // Every worker dies at once: their leases run out, the coordinator drops them
    // within two lease TTLs and the poll, and refuses new work with a typed error.
    sim.signal(Signal::Kill)?;
    let limit = Duration::from_secs(2 * LEASE_TTL_S + 3);
    opskit::poll("the coordinator seeing every simulated worker gone", limit, || {
        let http = http.clone();
        async move {
            let left = workers(&http, "decode", "serving").await? + workers(&http, "prefill", "serving").await?;
            Ok::<_, opskit::Error>((left == 0.0).then_some(()))
        }
    })
    .await?;
    let (status, body) = chat(&http, "anyone there?", 4).await?;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "no_worker", "{body}");
    drop(coordinator);
    drop(etcd);
    Ok(())
}

/// `tandem bench scale` on a fleet small enough for CI: every figure of its row measured,
/// not left at zero, and the killed share seen gone within two lease TTLs.
#[test]
fn bench_scale_measures_a_small_fleet() -> TestResult {
    let dir = log_dir("tandem-bench-scale-test")?;
    let json = dir.join("scale.json");
    let out = std::process::Command::new(opskit::process::bin("tandem")?)
        .args(["bench", "scale", "--sizes", "6", "--coordinators", "2", "--window-s", "2", "--lease-ttl-s", "2"])
        .arg("--json")
        .arg(&json)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("| 6 |"), "the table has the fleet's row: {stdout}");
    let rows: Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    let r = &rows[0];
    let f = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    // 6 workers polled by 2 coordinators every 250 ms: 48 a second at least.
    assert!(f("polls_per_s") >= 40.0, "{r}");
    // Each request moves its workers' queues: their load went out on the watch streams.
    assert!(f("load_updates_per_s") > 0.0, "{r}");
    assert!(f("coordinator_cpu_per_s") > 0.0 && f("coordinator_rss_mib") > 1.0 && f("series") > 10.0, "{r}");
    assert!(f("decisions") > 0.0 && f("decision_p99_us") >= f("decision_p50_us"), "{r}");
    assert!(f("decision_cpu_p50_us") > 0.0 && f("decision_cpu_p99_us") >= f("decision_cpu_p50_us"), "{r}");
    assert!(f("requests") > 0.0 && f("requests_ok") == f("requests"), "{r}");
    // Multi-turn chats on shared system prompts: something to hit, and never more hit
    // than the most cached anywhere (which bounds the oracle's choice too); changes
    // that were sent, timed.
    let most = f("most_cached_rate");
    assert!(f("oracle_hit_rate") > 0.0 && most >= f("hit_rate") && most >= f("oracle_hit_rate"), "{r}");
    assert!(f("freshness_p99_ms") >= f("freshness_p50_ms") && f("freshness_p50_ms") > 0.0, "{r}");
    assert_eq!(f("killed"), 1.0, "{r}");
    assert!(f("kill_convergence_s") < 2.0 * 2.0 + 1.0, "within two lease TTLs and a poll: {r}");
    Ok(())
}
