//! The alert rules and the dashboard against a real Prometheus (Debian's)
//! scraping a real `tandem up` cluster through the `file_sd` file it writes.
//!
//! The rules are deploy/prometheus/tandem-rules.yml with every time constant
//! divided by 15 (`[5m]` windows become `[20s]`, `for: 5m` becomes `for:
//! 20s`, `[15m]` becomes `[60s]`), and Prometheus scrapes and evaluates every
//! second: the same expressions, on a clock a test can wait for.
//!
//! What it shows, in one cluster: under an overload the shed alert goes
//! firing and the queue recording rule has data; after two `kill -9`s of a
//! worker (the supervisor restarts it each time) the restart alert fires;
//! once the load stops and the restarts age out, both resolve. Every
//! dashboard panel's query is sent to that Prometheus and answers without
//! error, and with at least one series when every metric it reads exists.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use facts::state::{Component, State, StateFile};
use opskit::http::{get, Request};
use opskit::{eventually, poll, within};
use serde_json::Value;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Model load, restarts and Prometheus evaluation on 2 cores.
const WAIT: Duration = Duration::from_secs(120);
/// The rules' clock: every duration divided by this.
const COMPRESS: u64 = 15;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A child killed (SIGKILL) when dropped; `tandem up` is stopped politely first by the test.
struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// `30s`, `5m`, `1h`, `1d` → seconds.
fn seconds(n: u64, unit: char) -> u64 {
    n * match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        _ => 86_400,
    }
}

/// The rules with every `[N<unit>]` window and `for: N<unit>` divided by [`COMPRESS`].
fn compressed_rules(text: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut changed = 0;
    for line in text.lines() {
        let mut l = String::new();
        let mut rest = line;
        // `for: 5m`
        if let Some(v) = line.trim_start().strip_prefix("for: ") {
            let (n, u) = v.trim().split_at(v.trim().len() - 1);
            let n: u64 = n.parse().map_err(|_| format!("for: {v}"))?;
            let s = (seconds(n, u.chars().next().unwrap_or('s')) / COMPRESS).max(1);
            let indent = &line[..line.len() - line.trim_start().len()];
            out.push_str(&format!("{indent}for: {s}s\n"));
            changed += 1;
            continue;
        }
        // `[5m]` inside expressions (not `[5m:1m]` subqueries; the rules have none).
        while let Some(i) = rest.find('[') {
            let Some(j) = rest[i..].find(']').map(|j| i + j) else { break };
            let inner = &rest[i + 1..j];
            let unit = inner.chars().last().unwrap_or(' ');
            match inner[..inner.len().saturating_sub(1)].parse::<u64>() {
                Ok(n) if "smhd".contains(unit) && !inner.is_empty() => {
                    l.push_str(&rest[..i]);
                    l.push_str(&format!("[{}s]", (seconds(n, unit) / COMPRESS).max(2)));
                    changed += 1;
                }
                _ => l.push_str(&rest[..=j]),
            }
            rest = &rest[j + 1..];
        }
        l.push_str(rest);
        out.push_str(&l);
        out.push('\n');
    }
    if changed < 20 {
        return Err(format!("only {changed} time constants found in the rules: did their syntax change?"));
    }
    Ok(out)
}

async fn query(prom: &str, expr: &str) -> Result<Vec<Value>, String> {
    let path = format!("/api/v1/query?query={}", urlencode(expr));
    let r = get(prom, &path).await.map_err(|e| e.to_string())?;
    let v = r.json().map_err(|e| e.to_string())?;
    if v["status"] != "success" {
        return Err(format!("{expr}: {} {}", r.status, r.text()));
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The state (`firing`, `pending`) of each active alert named `name`.
async fn alert_states(prom: &str, name: &str) -> Result<Vec<String>, String> {
    let v = get(prom, "/api/v1/alerts").await.map_err(|e| e.to_string())?.json().map_err(|e| e.to_string())?;
    Ok(v["data"]["alerts"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|x| x["labels"]["alertname"] == name)
                .filter_map(|x| x["state"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default())
}

async fn firing(prom: &str, name: &str) -> bool {
    alert_states(prom, name).await.is_ok_and(|s| s.iter().any(|s| s == "firing"))
}

/// `tandem up`'s state file (`facts::state`, the schema `tandem up` writes).
fn state(path: &Path) -> Result<StateFile, String> {
    StateFile::read(path).map_err(|e| e.to_string())
}

fn component(state: &StateFile, name: &str) -> Result<Component, String> {
    state.component(name).cloned().ok_or_else(|| format!("no component {name} in the state file"))
}

/// Kills `name` with SIGKILL and waits for the supervisor to have restarted
/// it (`restarts` one higher, a new pid, running).
async fn kill_and_await_restart(state_file: &Path, name: &str) -> TestResult {
    let before = component(&state(state_file)?, name)?;
    let (pid, restarts) = (before.pid, before.restarts);
    let killed = Command::new("kill").args(["-KILL", &pid.to_string()]).status()?;
    assert!(killed.success(), "kill -9 {pid}");
    poll(&format!("{name} restarted after kill -9 {pid}"), WAIT, || async {
        let c = component(&state(state_file)?, name)?;
        let ok = c.restarts == restarts + 1 && c.pid != pid && c.state == State::Running;
        Ok::<_, String>(ok.then_some(()))
    })
    .await?;
    Ok(())
}

/// `clients` callers, each sending one request after another until `stop`
/// (pausing 100 ms after a refusal): more callers than seats plus queue, so
/// admission sheds steadily while the served ones keep dispatching.
async fn flood(http: String, clients: usize, stop: tokio_util::sync::CancellationToken) -> (u64, u64) {
    let body = serde_json::json!({
        "model": "SmolLM2-135M-Instruct", "prompt": "Once upon a time", "max_tokens": 32,
        "temperature": 0, "ignore_eos": true,
    });
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (http, body, stop) = (http.clone(), body.clone(), stop.clone());
            tokio::spawn(async move {
                let (mut ok, mut refused) = (0u64, 0u64);
                while !stop.is_cancelled() {
                    let r = Request::post(&http, "/v1/completions").json(&body).timeout(Duration::from_secs(60));
                    match r.send().await.map(|r| r.status) {
                        Ok(200) => ok += 1,
                        Ok(429 | 503) => {
                            refused += 1;
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        _ => tokio::time::sleep(Duration::from_millis(100)).await,
                    }
                }
                (ok, refused)
            })
        })
        .collect();
    let (mut ok, mut refused) = (0, 0);
    for t in tasks {
        if let Ok((o, r)) = t.await {
            ok += o;
            refused += r;
        }
    }
    (ok, refused)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_alerts_fire_and_resolve_on_a_real_cluster_and_every_panel_query_answers() -> TestResult {
    let dir = std::env::temp_dir().join(format!("tandem-prometheus-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let state_file = dir.join("cluster.json");
    let targets = dir.join("targets.json");

    // The cluster: one prefill, one decode worker; a queue of 2 so a burst sheds.
    let http = format!("127.0.0.1:{}", free_port()?);
    let grpc = format!("127.0.0.1:{}", free_port()?);
    let up_log = std::fs::File::create(dir.join("up.log"))?;
    let mut up = Kid(Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["up", "--http", &http, "--grpc", &grpc, "--restart", "on-failure", "--restart-backoff-ms", "500"])
        // Placement reaches the workers (checked below, also after restarts).
        .args(["--prefill-nice", "3"])
        .arg("--state-file")
        .arg(&state_file)
        .arg("--prometheus-targets")
        .arg(&targets)
        .env("TANDEM_MAX_QUEUED", "2")
        .stdin(Stdio::null())
        .stdout(Stdio::from(up_log.try_clone()?))
        .stderr(Stdio::from(up_log))
        .spawn()?);
    eventually("the cluster ready (/ready 200)", WAIT, || async {
        opskit::http::status(&http, "/ready", Duration::from_secs(2)).await.is_ok_and(|s| s == 200)
    })
    .await?;

    // Prometheus: 1 s scrapes and evaluations of the compressed rules over the file_sd targets.
    let rules = compressed_rules(&std::fs::read_to_string(root().join("deploy/prometheus/tandem-rules.yml"))?)?;
    std::fs::write(dir.join("rules.yml"), rules)?;
    let config = format!(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files: [rules.yml]\nscrape_configs:\n  \
         - job_name: tandem\n    file_sd_configs:\n      - files: [{}]\n        refresh_interval: 1s\n",
        targets.display()
    );
    std::fs::write(dir.join("prometheus.yml"), config)?;
    let prom = format!("127.0.0.1:{}", free_port()?);
    let prom_log = std::fs::File::create(dir.join("prometheus.log"))?;
    let _prometheus = Kid(Command::new("prometheus")
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address={prom}"))
        .stdin(Stdio::null())
        .stdout(Stdio::from(prom_log.try_clone()?))
        .stderr(Stdio::from(prom_log))
        .spawn()
        .map_err(|e| format!("starting prometheus ({e}): run `make deps` (Debian's prometheus package)"))?);
    eventually("Prometheus ready", WAIT, || async {
        opskit::http::status(&prom, "/-/ready", Duration::from_secs(2)).await.is_ok_and(|s| s == 200)
    })
    .await?;
    eventually("every tandem up process scraped (up == 1)", WAIT, || async {
        query(&prom, "count(up == 1)").await.is_ok_and(|r| {
            r.first().and_then(|s| s["value"][1].as_str()).and_then(|v| v.parse::<u32>().ok()) == Some(4)
        })
    })
    .await?;

    // Overload: 24 callers against 16 seats and a queue of 2.
    let stop = tokio_util::sync::CancellationToken::new();
    let load = tokio::spawn(flood(http.clone(), 24, stop.clone()));
    let shed =
        eventually("TandemShedRateHigh firing under the overload", WAIT, || firing(&prom, "TandemShedRateHigh")).await;
    let queue = poll("the queue recording rule with data", WAIT, || async {
        let r = query(&prom, "tandem:queue_depth").await?;
        Ok::<_, String>((!r.is_empty()).then_some(r))
    })
    .await;
    stop.cancel();
    let (ok, refused) = within("the load stopping", WAIT, load).await??;
    shed?;
    queue?;
    assert!(ok > 0 && refused > 0, "the overload served {ok} and refused {refused}");

    // Two kill -9s of the decode worker, each restarted by tandem up; the next kill only
    // once Prometheus has scraped the new process (a crash loop's restarts are seconds
    // apart; two kills inside one scrape interval would be one restart to any scraper).
    let started = || async {
        let r = query(&prom, "tandem_process_start_time_seconds{component=\"decode-0\"}").await?;
        let v = r.first().and_then(|s| s["value"][1].as_str()).and_then(|v| v.parse::<f64>().ok());
        Ok::<_, String>(v)
    };
    let mut last = poll("decode-0's start time scraped", WAIT, started).await?;
    for _ in 0..2 {
        kill_and_await_restart(&state_file, "decode-0").await?;
        last = poll("the restarted decode-0's start time scraped", WAIT, || async {
            Ok::<_, String>(started().await?.filter(|t| *t != last))
        })
        .await?;
    }
    eventually("TandemProcessRestarting firing after two kill -9s", WAIT, || firing(&prom, "TandemProcessRestarting"))
        .await?;
    let st = state(&state_file)?;
    for (name, want) in [("prefill-0", 3), ("decode-0", 0)] {
        let pid = component(&st, name)?.pid;
        assert_eq!(nice_of(pid)?, want, "{name}'s nice level (tandem up --prefill-nice 3)");
    }

    // Every dashboard panel's query answers; with a series where its metrics exist.
    let board: Value = serde_json::from_str(&std::fs::read_to_string(root().join("deploy/grafana/tandem.json"))?)?;
    let exprs: Vec<String> = board["panels"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect();
    assert!(exprs.len() >= 30, "only {} panel queries in the dashboard", exprs.len());
    let (mut with_data, mut problems) = (0, Vec::new());
    for e in &exprs {
        let q = e.replace("$__rate_interval", "1m").replace("$version_group", ".*");
        match query(&prom, &q).await {
            Err(err) => problems.push(format!("{e}: {err}")),
            Ok(r) if !r.is_empty() => with_data += 1,
            Ok(_) => {
                let mut missing = Vec::new();
                for name in metric_names(&q) {
                    if query(&prom, &format!("count({{__name__=\"{name}\"}})")).await.map_or(true, |r| r.is_empty()) {
                        missing.push(name);
                    }
                }
                if missing.is_empty() {
                    problems.push(format!("{e}: no series although every metric it reads exists"));
                }
            }
        }
    }
    assert!(problems.is_empty(), "dashboard queries:\n{}", problems.join("\n"));
    assert!(with_data >= exprs.len() / 2, "only {with_data} of {} panel queries returned data", exprs.len());

    // Both resolve: no sheds in the (compressed) 5-minute window, restarts older than 15 minutes.
    eventually("TandemShedRateHigh resolved after the load", WAIT, || async {
        alert_states(&prom, "TandemShedRateHigh").await.is_ok_and(|s| s.is_empty())
    })
    .await?;
    eventually("TandemProcessRestarting resolved once the restarts aged out", WAIT, || async {
        alert_states(&prom, "TandemProcessRestarting").await.is_ok_and(|s| s.is_empty())
    })
    .await?;

    let _ = Command::new("kill").args(["-TERM", &up.0.id().to_string()]).status();
    let exited = poll("tandem up stopping", WAIT, || {
        let s = up.0.try_wait().map_err(|e| e.to_string()).map(|s| s.map(|s| s.success()));
        async move { s }
    })
    .await?;
    assert!(exited, "tandem up exited with an error after SIGTERM");
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A process's nice level (`/proc/PID/stat` field 19).
fn nice_of(pid: u32) -> Result<i64, String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|e| e.to_string())?;
    // After the `(comm)` field, which may hold spaces: state is field 3, nice field 19.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).ok_or("no comm")?;
    rest.split_whitespace().nth(16).and_then(|v| v.parse().ok()).ok_or_else(|| format!("bad stat: {stat}"))
}

/// The metric and recording-rule names an expression reads (`tandem_...`, `tandem:...`, `up`).
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let bytes: Vec<char> = expr.chars().collect();
    let mut i = 0;
    while i < bytes.len() {
        let word_start =
            i == 0 || !(bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == '_' || bytes[i - 1] == ':');
        if word_start
            && (expr[i..].starts_with("tandem_") || expr[i..].starts_with("tandem:") || expr[i..].starts_with("up{"))
        {
            let mut j = i;
            while j < bytes.len() && (bytes[j].is_ascii_alphanumeric() || bytes[j] == '_' || bytes[j] == ':') {
                j += 1;
            }
            out.push(expr[i..j].to_owned());
            i = j;
        } else {
            i += 1;
        }
    }
    out.sort();
    out.dedup();
    out
}

#[test]
fn the_compression_divides_windows_and_for_durations_and_nothing_else() {
    let text = "      - record: tandem:shed:ratio_rate5m\n        expr: rate(x[5m]) / rate(y[15m]) > on() z{a=\"[b]\"}\n        for: 5m\n";
    let out = compressed_rules(&text.repeat(10)).expect("compressed");
    assert!(out.contains("tandem:shed:ratio_rate5m"), "{out}");
    assert!(out.contains("rate(x[20s]) / rate(y[60s])"), "{out}");
    assert!(out.contains("z{a=\"[b]\"}"), "{out}");
    assert!(out.contains("        for: 20s\n"), "{out}");
    assert!(compressed_rules("expr: up\n").is_err(), "a rules file without time constants is suspicious");
}
