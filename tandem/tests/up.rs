//! `tandem up` starts a real local cluster (etcd, prefill worker, decode
//! worker, coordinator routing from etcd), writes the state file, serves the OpenAI API, and on
//! SIGTERM stops every process it started and exits 0.
//!
//! The worker and coordinator binaries are `tandem`'s siblings in the
//! target directory (`make test` builds every binary first).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use common::{post, running, TestResult, Up};
use std::process::{Command, Stdio};

fn post_chat(addr: &str) -> Result<(u16, String), String> {
    let body = r#"{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"What is the capital of France? Answer in one sentence."}],"max_tokens":32,"temperature":0}"#;
    post(addr, "/v1/chat/completions", body).map_err(|e| e.to_string())
}

/// Greedy continuation of `ids` from the single-process engine, as text.
fn reference(ids: &[u32], max_tokens: u32) -> Result<String, Box<dyn std::error::Error>> {
    use engine::batch::{Engine, EngineConfig, Request};
    let path = engine::paths::default_model_path();
    let (w, gguf) = engine::weights::Weights::from_gguf(&path)?;
    let tok = engine::tokenizer::Tokenizer::from_gguf(&gguf)?;
    let model = engine::model::Model::new(w, 1)?;
    let mut e = Engine::new(model, EngineConfig::default(), tok.eos_ids().to_vec())?;
    let params = types::sampling::SamplingParams { max_tokens, ..Default::default() };
    e.add(Request {
        id: 1,
        prompt: ids.to_vec(),
        params,
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    })?;
    let mut out = Vec::new();
    while e.has_work() {
        for ev in e.step()? {
            if !tok.eos_ids().contains(&ev.token.id) {
                out.push(ev.token.id);
            }
        }
    }
    Ok(tok.decode(&out, true)?)
}

/// The official `openai` Python client against the cluster: greedy chat and
/// completions, streaming and not, equal the single-process engine's
/// output, with usage. Python comes from `make test` (scripts/python-deps.sh
/// sets TANDEM_PYTHON).
fn openai_client_agrees_with_the_engine(http: &str) -> Result<(), Box<dyn std::error::Error>> {
    let python = std::env::var("TANDEM_PYTHON").map_err(|_| {
        "TANDEM_PYTHON is not set: run `make test`, or `export TANDEM_PYTHON=$(scripts/python-deps.sh | tail -n 1)`"
    })?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/openai-client-check.py");
    let out = Command::new(&python)
        .args([script, "--base-url", &format!("http://{http}/v1"), "--max-tokens", "16"])
        .stderr(Stdio::inherit())
        .output()?;
    assert!(out.status.success(), "the openai client failed: {}", String::from_utf8_lossy(&out.stdout));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(v["models"][0], "SmolLM2-135M-Instruct", "{v}");

    let (s, body) =
        post(http, "/tokenize", r#"{"messages":[{"role":"user","content":"What is the capital of France?"}]}"#)?;
    assert_eq!(s, 200, "{body}");
    let chat_ids: Vec<u32> =
        serde_json::from_value(serde_json::from_str::<serde_json::Value>(&body)?["tokens"].clone())?;
    let (s, body) = post(http, "/tokenize", r#"{"prompt":"The capital of France is"}"#)?;
    assert_eq!(s, 200, "{body}");
    let prompt_ids: Vec<u32> =
        serde_json::from_value(serde_json::from_str::<serde_json::Value>(&body)?["tokens"].clone())?;
    for (case, ids) in [
        ("chat", &chat_ids),
        ("chat_stream", &chat_ids),
        ("completion", &prompt_ids),
        ("completion_stream", &prompt_ids),
    ] {
        let want = reference(ids, 16)?;
        let got = &v[case];
        assert_eq!(got["text"].as_str(), Some(want.as_str()), "{case}: {v}");
        assert_eq!(got["usage"]["prompt_tokens"], ids.len(), "{case}: {v}");
        let completion_tokens = got["usage"]["completion_tokens"].as_u64().ok_or("no completion_tokens")?;
        assert!((1..=16).contains(&completion_tokens), "{case}: {v}");
        assert_eq!(got["usage"]["total_tokens"].as_u64(), Some(ids.len() as u64 + completion_tokens), "{case}: {v}");
        assert!(matches!(got["finish"].as_str(), Some("stop" | "length")), "{case}: {v}");
    }
    Ok(())
}

#[test]
fn up_serves_the_openai_api_and_stops_everything_on_sigterm() -> TestResult {
    let dir = common::temp_dir("tandem-up-test")?;
    let mut up = Up::start(&dir, &[])?;
    let result = (|| -> TestResult {
        let v = &up.state;
        let comps = up.components()?;
        let roles: Vec<&str> = comps.iter().map(|c| c.role.as_str()).collect();
        assert_eq!(roles, ["etcd", "prefill", "decode", "coordinator"], "{v:?}");
        for c in comps {
            assert!(running(c.pid), "{c:?}");
        }
        assert!(comps[0].grpc.is_some(), "etcd's client address: {v:?}");
        assert!(comps[1].grpc.is_some() && comps[1].metrics.is_some() && comps[1].http.is_none(), "{v:?}");
        let transfer = comps[2].transfer.as_deref();
        assert!(transfer.is_some_and(|t| t.starts_with('@')), "shared memory by default: {v:?}");
        assert!(comps[3].grpc.is_some(), "the coordinator's gRPC frontend: {v:?}");
        let http = up.http()?;
        assert_eq!(comps[3].metrics.as_deref(), Some(http.as_str()), "the coordinator's /metrics is on its HTTP port");
        // Prometheus file_sd: one target per process, at the address the state file names.
        let targets = dir.join("state.json.logs").join("prometheus-targets.json");
        let sd: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&targets)?)?;
        let listed: Vec<&str> =
            sd.as_array().ok_or("not a list")?.iter().filter_map(|g| g["targets"][0].as_str()).collect();
        let metrics: Vec<&str> = comps.iter().filter_map(|c| c.metrics.as_deref()).collect();
        assert_eq!(listed, metrics, "{sd}");
        assert_eq!(listed.len(), comps.len(), "every process has a target: {sd}");
        let (status, body) = post_chat(&http)?;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("chat.completion") && body.contains("Paris"), "{body}");
        openai_client_agrees_with_the_engine(&http)?;
        // A second `tandem up` on the same state file (so the same log and etcd data
        // directories, which the first one's stop removes) is refused, naming the first.
        let second = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["up", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0", "--state-file"])
            .arg(&up.state_file)
            .output()?;
        let err = String::from_utf8_lossy(&second.stderr);
        assert!(!second.status.success() && err.contains(&format!("another tandem up (pid {})", up.pid)), "{err}");
        // Every series each process exports is in the metric catalog under it, with its
        // label names: the catalog cannot drift from what the processes export.
        use facts::metrics::Process;
        for (c, p) in comps.iter().skip(1).zip([Process::Prefill, Process::Decode, Process::Coordinator]) {
            let addr = c.metrics.as_deref().ok_or("no metrics address")?;
            let n = common::matches_catalog(addr, p)?;
            assert!(n >= 20, "{p:?} exported only {n} tandem_ series");
        }

        let pids: Vec<(&str, u32)> = comps.iter().map(|c| (c.role.as_str(), c.pid)).collect();
        let status = up.stop()?;
        assert!(status.success(), "tandem up exit: {status:?}");
        for (role, pid) in pids {
            assert!(!running(pid), "{role} (pid {pid}) is still running");
        }
        assert!(!up.state_file.exists(), "the state file is removed on stop");
        assert!(!targets.exists(), "the Prometheus targets file is removed on stop");
        Ok(())
    })();
    drop(up);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// `tandem up --prefill 0`: decode workers alone, prefilling locally, make a
/// cluster the coordinator calls ready and that serves.
#[test]
fn up_with_decode_workers_only_is_ready_and_serves() -> TestResult {
    let dir = common::temp_dir("tandem-up-decode-only-test")?;
    let mut up = Up::start(&dir, &["--prefill", "0"])?;
    let result = (|| -> TestResult {
        let roles: Vec<&str> = up.components()?.iter().map(|c| c.role.as_str()).collect();
        assert_eq!(roles, ["etcd", "decode", "coordinator"], "{:?}", up.state);
        let http = up.http()?;
        let (status, body) = post_chat(&http)?;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("Paris"), "{body}");
        let status = up.stop()?;
        assert!(status.success(), "tandem up exit: {status:?}");
        Ok(())
    })();
    drop(up);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// `tandem up --kv-transport ucx`: the decode worker receives KV by UCX puts,
/// and the cluster serves a chat completion whose prompt was prefilled by
/// the prefill worker and crossed over ucx.
#[test]
fn up_with_the_ucx_transport_serves_a_chat_completion() -> TestResult {
    use facts::metrics::decode::{KV_RECEIVED_BYTES, PREFILL_ROUTE, TRANSPORT_INFO, UCX_LANDING_IN_USE};
    let dir = common::temp_dir("tandem-up-ucx-test")?;
    let mut up = Up::start(&dir, &["--kv-transport", "ucx"])?;
    let result = (|| -> TestResult {
        let decode = up.component("decode-0")?;
        let metrics = decode.metrics.as_deref().ok_or_else(|| format!("no decode metrics address: {decode:?}"))?;
        assert_eq!(common::metric(metrics, TRANSPORT_INFO, &[("transport", "ucx")])?, 1.0, "{decode:?}");
        let http = up.http()?;
        let (status, body) = post_chat(&http)?;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("chat.completion") && body.contains("Paris"), "{body}");
        // The templated prompt is past the local-prefill limit: its KV came over ucx.
        assert_eq!(common::metric(metrics, PREFILL_ROUTE, &[("route", "remote")])?, 1.0, "{}", up.stderr_text());
        let bytes = common::metric(metrics, KV_RECEIVED_BYTES, &[])?;
        assert!(bytes > 0.0 && bytes % 368_640.0 == 0.0, "KV bytes over ucx: {bytes}");
        // Freed at Complete; the gauge follows the server's stats a moment later.
        common::wait_for(std::time::Duration::from_secs(30), "the landing region free again", || {
            Ok((common::metric(metrics, UCX_LANDING_IN_USE, &[])? == 0.0).then_some(()))
        })?;
        let status = up.stop()?;
        assert!(status.success(), "tandem up exit: {status:?}");
        Ok(())
    })();
    drop(up);
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// `--hosts 2`: each worker in its own network namespace on a bridge, KV over tcp across
/// them (the default there), etcd reached on the bridge; the state file names each worker's
/// namespace and gives it a `link-fault` template that acts inside it; a drop rule there
/// stops the coordinator reaching that worker, and lifting it brings it back. On stop,
/// the namespaces and the bridge are gone. `--kv-transport local` is refused with them.
#[test]
fn up_on_hosts_places_workers_in_namespaces_and_cleans_them_up() -> TestResult {
    use facts::metrics::decode::{KV_RECEIVED_BYTES, PREFILL_ROUTE, TRANSPORT_INFO};
    use facts::state::Action;
    let dir = common::temp_dir("tandem-up-hosts-test")?;
    let refused = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["up", "--hosts", "2", "--kv-transport", "local", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
        .output()?;
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("does not cross --hosts"), "{err}");

    let refused = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(["up", "--coordinator-hosts", "--http", "127.0.0.1:0", "--grpc", "127.0.0.1:0"])
        .output()?;
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("--hosts"), "--coordinator-hosts needs --hosts: {err}");

    let mut up = Up::start(&dir, &["--hosts", "2", "--coordinator-hosts", "--lease-ttl-s", "2"])?;
    let up_pid = up.pid;
    let namespaces = || -> Result<Vec<String>, String> {
        let out = Command::new("ip").args(["netns", "list"]).output().map_err(|e| e.to_string())?;
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|n| n.starts_with(&format!("tandem-up-{up_pid}-")))
            .map(str::to_owned)
            .collect())
    };
    let result = (|| -> TestResult {
        let (prefill, decode) = (up.component("prefill-0")?, up.component("decode-0")?);
        let (pns, dns) = (prefill.netns.clone().ok_or("prefill netns")?, decode.netns.clone().ok_or("decode netns")?);
        assert_ne!(pns, dns, "one worker per host");
        let coordinator = up.component("coordinator")?;
        let cns = coordinator.netns.clone().ok_or("coordinator netns (--coordinator-hosts)")?;
        let mut listed = namespaces()?;
        listed.sort();
        let mut expected = vec![pns.clone(), dns.clone(), cns.clone()];
        expected.sort();
        assert_eq!(listed, expected, "the state file names the namespaces that exist: the coordinator's its own");
        let chttp = coordinator.http.clone().ok_or("coordinator http")?;
        assert!(chttp.starts_with("10.79."), "the coordinator listens on its host's address: {chttp}");
        let transfer = decode.transfer.clone().ok_or("transfer")?;
        assert!(transfer.starts_with("10.79."), "KV listens on the host's address: {transfer}");
        let metrics = decode.metrics.clone().ok_or("metrics")?;
        assert_eq!(common::metric(&metrics, TRANSPORT_INFO, &[("transport", "tcp")])?, 1.0, "tcp across hosts");
        // The worker runs inside its namespace: its network is that namespace's.
        let own = std::fs::read_link(format!("/proc/{}/ns/net", decode.pid))?;
        let named = std::fs::metadata(format!("/run/netns/{dns}"))?;
        use std::os::unix::fs::MetadataExt;
        assert_eq!(own.to_string_lossy(), format!("net:[{}]", named.ino()), "decode-0 is in {dns}");
        let own = std::fs::read_link(format!("/proc/{}/ns/net", coordinator.pid))?;
        let named = std::fs::metadata(format!("/run/netns/{cns}"))?;
        assert_eq!(own.to_string_lossy(), format!("net:[{}]", named.ino()), "the coordinator is in {cns}");

        let http = up.http()?;
        let (status, body) = post_chat(&http)?;
        assert_eq!(status, 200, "{body}");
        assert!(body.contains("Paris"), "{body}");
        assert_eq!(common::metric(&metrics, PREFILL_ROUTE, &[("route", "remote")])?, 1.0, "{}", up.stderr_text());
        assert!(common::metric(&metrics, KV_RECEIVED_BYTES, &[])? > 0.0, "KV crossed from {pns} to {dns}");

        // The link-fault template acts inside the worker's namespace: cutting its link to
        // etcd (on the bridge's address) lets its lease expire, so it leaves routing;
        // deleting the rule brings it back.
        let etcd = up.component("etcd")?.grpc.ok_or("etcd address")?;
        let (gateway, port) = etcd.rsplit_once(':').ok_or("etcd host:port")?;
        assert!(gateway.starts_with("10.79."), "etcd listens on the bridge: {etcd}");
        let rule = format!("OUTPUT -d {gateway} -p tcp --dport {port} -j DROP");
        let actions = decode.actions();
        let act = |cmd: String| -> Result<String, String> {
            let c = actions.command(Action::LinkFault, decode.pid, Some(&cmd))?;
            opskit::process::run_shell(&c, opskit::process::ACTION_WAIT).map_err(|e| e.to_string())
        };
        act(format!("iptables -A {rule}"))?;
        let listed = act("iptables -S OUTPUT".into())?;
        assert!(listed.contains(&format!("--dport {port} -j DROP")), "the rule is in {dns}: {listed}");
        let host_rules = Command::new("iptables").args(["-S", "OUTPUT"]).output()?;
        assert!(!String::from_utf8_lossy(&host_rules.stdout).contains(port), "and not on the host");
        common::serving(&http, "decode", 0.0, common::WAIT)?;
        act(format!("iptables -D {rule}"))?;
        common::serving(&http, "decode", 1.0, common::WAIT)?;
        let (status, body) = post_chat(&http)?;
        assert_eq!(status, 200, "served again: {body}");

        let status = up.stop()?;
        assert!(status.success(), "tandem up exit: {status:?}");
        assert_eq!(namespaces()?, Vec::<String>::new(), "the namespaces are deleted on stop");
        let bridge = Command::new("ip").args(["link", "show", &format!("tup{up_pid}")]).output()?;
        assert!(!bridge.status.success(), "the bridge is deleted on stop");
        Ok(())
    })();
    drop(up);
    let _ = std::fs::remove_dir_all(&dir);
    result
}
