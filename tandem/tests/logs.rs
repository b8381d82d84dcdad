//! What on-call reads and a pod's size: every binary logs at INFO when nobody set a
//! filter, `--log-format json` gives one JSON object per line, the coordinator's
//! `--metrics-addr` moves `/metrics` off the client port, and a worker without
//! `--threads` runs as many compute threads as its CPU quota allows (a pod's limit), not
//! as the node has cores.
//!
//! Real processes (a decode worker with the real model, a coordinator), started with
//! `TANDEM_LOG` and `RUST_LOG` empty (empty is unset), so that a filter in the test
//! runner's environment cannot make the test pass.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use common::{get, TestResult, WAIT};
use opskit::process::Launch;
use serde_json::Value;

/// No filter anywhere: `facts::log`'s default must apply.
fn unset_logs(l: Launch) -> Launch {
    l.env("TANDEM_LOG", "").env("RUST_LOG", "")
}

fn log_of(p: &opskit::process::Proc) -> String {
    std::fs::read_to_string(p.log_path()).unwrap_or_default()
}

/// A CPU cgroup allowing `cpus` CPUs of time, removed on drop: cgroup v1's `cpu`
/// controller where it is mounted, else cgroup v2 (the `cpu` controller enabled for the
/// root's children).
struct CpuQuota(std::path::PathBuf);

impl CpuQuota {
    fn new(name: &str, cpus: usize) -> Result<Self, String> {
        let write = |path: std::path::PathBuf, text: &str| {
            std::fs::write(&path, text).map_err(|e| format!("writing {text:?} to {}: {e}", path.display()))
        };
        let v1 = std::path::Path::new("/sys/fs/cgroup/cpu");
        let v2 = std::path::Path::new("/sys/fs/cgroup");
        let period = 100_000;
        let dir = if v1.join("cpu.cfs_quota_us").exists() {
            let dir = v1.join(name);
            std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
            write(dir.join("cpu.cfs_period_us"), &period.to_string())?;
            write(dir.join("cpu.cfs_quota_us"), &(period * cpus).to_string())?;
            dir
        } else if std::fs::read_to_string(v2.join("cgroup.controllers")).is_ok_and(|c| c.contains("cpu")) {
            write(v2.join("cgroup.subtree_control"), "+cpu")?;
            let dir = v2.join(name);
            std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
            write(dir.join("cpu.max"), &format!("{} {period}", period * cpus))?;
            dir
        } else {
            return Err("no writable CPU cgroup (v1 `cpu` or v2 with the `cpu` controller): run as root".into());
        };
        Ok(Self(dir))
    }

    /// A `Launch::prefix` that moves the process into this cgroup, then execs it.
    fn prefix(&self) -> Vec<String> {
        let procs = self.0.join("cgroup.procs");
        vec!["sh".into(), "-c".into(), format!("echo $$ > {} && exec \"$@\"", procs.display()), "sh".into()]
    }
}

impl Drop for CpuQuota {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

#[test]
fn a_worker_with_no_log_settings_logs_info_and_sizes_its_threads_to_its_cpu_quota() -> TestResult {
    let cores = std::thread::available_parallelism()?.get();
    assert!(cores >= 2, "a quota below the machine's cores needs 2 CPUs; this machine has {cores}");
    let quota = CpuQuota::new(&format!("tandem-logs-{}", std::process::id()), 1)?;
    let dir = common::temp_dir("logs-worker")?;
    let args = ["--version-group", "logs", "--kv-blocks", "64", "--kv-load-failure-policy", "recompute"];
    let worker =
        unset_logs(Launch::bin("tandem-decode-worker").prefix(&quota.prefix()).args(args).wants(&["grpc"]).wait(WAIT))
            .log_file(&dir.join("decode.log"))
            .start_blocking()?;
    let log = log_of(&worker);
    for line in ["starting", "ready"] {
        let found = log.lines().any(|l| l.contains(" INFO ") && l.contains(line));
        assert!(found, "no INFO line with `{line}` in the worker's log:\n{log}");
    }
    // No --threads: one compute thread per CPU of quota, not per core of the host.
    assert!(log.contains("threads=1"), "a 1-CPU quota on {cores} cores gives 1 thread:\n{log}");
    drop(worker);
    Ok(())
}

#[test]
fn json_lines_parse_and_metrics_leave_the_client_port() -> TestResult {
    let dir = common::temp_dir("logs-coordinator")?;
    let args = [
        "--http",
        "127.0.0.1:0",
        "--grpc",
        "127.0.0.1:0",
        "--metrics-addr",
        "127.0.0.1:0",
        "--decode",
        "127.0.0.1:1",
        "--log-format",
        "json",
    ];
    let coord = unset_logs(Launch::bin("tandem-coordinator").args(args).wants(&["http", "metrics"]).wait(WAIT))
        .log_file(&dir.join("coordinator.log"))
        .start_blocking()?;
    let (http, metrics) = (coord.addr("http")?, coord.addr("metrics")?);

    // The client port has no /metrics: an OpenAI 404 like any unknown path.
    let (status, body) = get(&http, "/metrics")?;
    let e: Value = serde_json::from_str(&body)?;
    assert_eq!((status, e["error"]["code"].as_str()), (404, Some("unknown_url")), "{body}");
    // The metrics listener has it, and nothing else but /health.
    let (status, body) = get(&metrics, "/metrics")?;
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("tandem_coordinator_"), "the coordinator's series:\n{body}");
    assert_eq!(get(&metrics, "/health")?.0, 200);
    let (status, body) = get(&metrics, "/v1/models")?;
    assert_eq!(status, 404, "the metrics listener serves no API: {body}");

    let log = log_of(&coord);
    let lines: Vec<Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).map_err(|e| format!("a log line is not JSON ({e}): {l}")))
        .collect::<Result<_, _>>()?;
    let start = lines.iter().find(|l| l["fields"]["message"] == "starting");
    let start = start.ok_or_else(|| format!("no `starting` line:\n{log}"))?;
    assert_eq!(start["level"], "INFO", "{start}");
    assert_eq!(start["fields"]["http"], "127.0.0.1:0", "the line's fields are JSON fields: {start}");
    assert!(start["timestamp"].is_string() && start["target"].is_string(), "{start}");
    Ok(())
}

#[test]
fn a_bad_filter_or_format_is_refused_naming_it() -> TestResult {
    let coordinator = opskit::process::bin("tandem-coordinator")?;
    let run = |env: &[(&str, &str)], args: &[&str]| {
        let out = std::process::Command::new(&coordinator)
            .args(["--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--decode", "127.0.0.1:1"])
            .args(args)
            .env("RUST_LOG", "")
            .envs(env.iter().copied())
            .output()
            .expect("running tandem-coordinator");
        (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let (ok, err) = run(&[("TANDEM_LOG", "coordinator=loud")], &[]);
    assert!(!ok && err.contains("TANDEM_LOG") && err.contains("coordinator=loud"), "{err}");
    let (ok, err) = run(&[("TANDEM_LOG", "")], &["--log-format", "xml"]);
    assert!(!ok && err.contains("xml") && err.contains("text, json"), "{err}");
    Ok(())
}
