//! `tandem up` supervises its processes: a worker killed with SIGKILL under
//! load comes back (new pid, same addresses, `restarts: 1`) while the others
//! keep serving, and a worker that crashes at every start is given up on
//! while the cluster keeps serving with the rest.
//!
//! Real processes: `tandem up` (etcd, workers, coordinator) and the
//! `loadgen` client over loopback.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use std::time::Duration;

use common::{metric, plan, running, serving, wait_for, Role, TestResult, Up};
use facts::state::State;
use loadgen::{Hooks, Outcome, Record};

/// Bound on a killed worker being back and serving: its backoff, its start-up, and the
/// lease of its dead predecessor running out (2 s) before it can register under its name.
const BACK_WITHIN: Duration = Duration::from_secs(90);

fn kill9(pid: u32) -> Result<(), String> {
    let ok =
        std::process::Command::new("kill").args(["-KILL", &pid.to_string()]).status().map_err(|e| e.to_string())?;
    if ok.success() {
        Ok(())
    } else {
        Err(format!("kill -9 {pid} failed"))
    }
}

/// Waits until the state file shows `name` running again with `restarts` restarts and a pid
/// other than `old`, and that pid alive; returns the new pid.
fn back(up: &mut Up, name: &str, old: u32, restarts: u32) -> Result<u32, String> {
    wait_for(BACK_WITHIN, &format!("{name} restarted (restarts: {restarts})"), || {
        up.reload()?;
        let c = up.component(name)?;
        let pid = c.pid;
        let ok = c.state == State::Running && c.restarts == restarts && pid != old && running(pid);
        Ok(ok.then_some(pid))
    })
}

/// Stops `tandem up` (which must exit cleanly), removes the test's directory and returns the
/// test's result, with `tandem up`'s stderr on a failure.
fn finish(mut up: Up, dir: &std::path::Path, result: TestResult) -> TestResult {
    let result = result.map_err(|e| format!("{e}\ntandem up's stderr:\n{}", up.stderr_text()).into());
    let status = up.stop()?;
    assert!(status.success(), "tandem up exit: {status:?}");
    let _ = std::fs::remove_dir_all(dir);
    result
}

#[test]
fn killed_workers_come_back_while_the_others_keep_serving() -> TestResult {
    let dir = common::temp_dir("tandem-supervise-kill")?;
    let mut up =
        Up::start(&dir, &["--prefill", "2", "--decode", "2", "--restart-backoff-ms", "500", "--lease-ttl-s", "2"])?;
    let result = (|| -> TestResult {
        let rt = tokio::runtime::Runtime::new()?;
        let http = up.http()?;
        let hooks = Hooks::default();
        let (tx, mut done) = tokio::sync::mpsc::unbounded_channel::<Record>();
        let hooks = Hooks { records: Some(tx), ..hooks };
        let cancel = hooks.cancel.clone();
        let p = plan(&http);
        let load = rt.spawn(async move { loadgen::run_with(&p, hooks).await });
        let mut completed = 0usize;
        let mut progress = |n: usize, what: &str| -> Result<(), String> {
            let want = completed + n;
            wait_for(BACK_WITHIN, what, || {
                while let Ok(r) = done.try_recv() {
                    completed += usize::from(r.outcome.is_complete());
                }
                Ok((completed >= want).then_some(()))
            })
        };
        progress(3, "3 requests completing before any kill")?;

        for name in ["prefill-1", "decode-0"] {
            let c = up.component(name)?;
            let (old, addrs) = (c.pid, (c.grpc.clone(), c.metrics.clone()));
            kill9(old)?;
            let new = back(&mut up, name, old, 1)?;
            let c = up.component(name)?;
            assert_eq!(c.last_exit.as_deref(), Some("signal 9 (SIGKILL)"), "{c:?}");
            assert_eq!(addrs, (c.grpc.clone(), c.metrics.clone()), "{name} keeps its addresses across the restart");
            assert!(addrs.0.is_some() && addrs.1.is_some(), "{c:?}");
            let role = if name.starts_with("prefill") { "prefill" } else { "decode" };
            serving(&http, role, 2.0, BACK_WITHIN)?;
            progress(3, &format!("3 more requests completing after {name} came back as pid {new}"))?;
        }
        cancel.cancel();
        let report = rt.block_on(load)??;

        // Only the streams running on the killed decode worker may fail, and only typed.
        let failed: Vec<&Outcome> = report.records.iter().map(|r| &r.outcome).filter(|o| !o.is_complete()).collect();
        for o in &failed {
            let typed = matches!(o, Outcome::StreamError { code: Some(c), .. } | Outcome::HttpError { code: Some(c), .. }
                if c == "worker_stream");
            assert!(typed, "a request failed other than with a typed worker_stream error: {o:?}");
        }
        assert!(failed.len() <= 3, "more failures than streams in flight (3): {failed:?}");
        assert!(report.records.len() > failed.len() + 9, "the load kept completing: {} records", report.records.len());

        // Every worker, the restarted ones included, ends with no KV in use.
        for c in up.components()?.iter().filter(|c| matches!(c.role, Role::Prefill | Role::Decode)) {
            let m = c.metrics.clone().ok_or("no metrics address")?;
            wait_for(Duration::from_secs(30), &format!("{} KV back to 0", c.name), || {
                let used = metric(&m, facts::metrics::worker::KV_BLOCKS_USED, &[])?;
                Ok((used == 0.0).then_some(()))
            })?;
        }
        let err = up.stderr_text();
        for line in ["prefill-1 (pid", "decode-0 restarted as pid"] {
            assert!(err.contains(line), "tandem up's stderr says {line:?}: {err}");
        }
        Ok(())
    })();
    finish(up, &dir, result)
}

#[test]
fn a_worker_crashing_at_every_start_is_given_up_and_the_cluster_keeps_serving() -> TestResult {
    let dir = common::temp_dir("tandem-supervise-crashloop")?;
    // The workers read this copy; once they run, a broken file takes its place, so only a
    // process started after that fails (a bad model rollout on one host).
    let model = dir.join("model.gguf");
    std::fs::copy(engine::paths::default_model_path(), &model)?;
    let model_s = model.display().to_string();
    let mut up = Up::start(
        &dir,
        &["--model", &model_s, "--prefill", "2", "--restart-backoff-ms", "100", "--restart-backoff-max-ms", "400"],
    )?;
    let result = (|| -> TestResult {
        let broken = dir.join("model.gguf.new");
        std::fs::write(&broken, b"GGUF but not a model")?;
        std::fs::rename(&broken, &model)?;
        let old = up.component("prefill-1")?.pid;
        kill9(old)?;
        let c = wait_for(Duration::from_secs(120), "prefill-1 given up", || {
            up.reload()?;
            let c = up.component("prefill-1")?;
            Ok((c.state == State::GivenUp).then_some(c))
        })?;
        // The kill and four failed starts: five exits within a minute.
        assert_eq!(c.restarts, 4, "{c:?}");
        // It exits before it listens: the start itself fails.
        assert!(c.last_exit.as_deref().is_some_and(|e| e.starts_with("start failed")), "{c:?}");
        assert!(!running(c.pid), "{c:?}");
        let err = up.stderr_text();
        assert!(err.contains("GIVING UP on prefill-1"), "{err}");
        let log = std::fs::read_to_string(c.log.as_ref().ok_or("no log")?)?;
        assert_eq!(log.matches("===== tandem up: restart").count(), 4, "one separator per restart");
        assert_eq!(log.matches("Error: loading").count(), 4, "each restart failed on the model: {log}");

        // Everything else still runs and serves.
        for c in up.components()?.iter().filter(|c| c.name != "prefill-1") {
            assert_eq!(c.state, State::Running, "{c:?}");
            assert!(running(c.pid), "{c:?}");
        }
        let (status, body) = common::post(
            &up.http()?,
            "/v1/completions",
            r#"{"model":"SmolLM2-135M-Instruct","prompt":"The capital of France is","max_tokens":4,"temperature":0}"#,
        )?;
        assert_eq!(status, 200, "{body}");
        Ok(())
    })();
    finish(up, &dir, result)
}

/// The workers' lease TTL in the etcd-members test.
const LEASE_TTL: Duration = Duration::from_secs(2);
/// How long the killed etcd member stays down there: long enough for the two left to elect
/// a leader (etcd's election timeout is 1 s) and serve a request before it is back. Started
/// again at once, it could win the election itself.
const RESTART_BACKOFF_MS: u64 = 10_000;

/// `--etcd-members 3`: three etcd processes, each in the state file; the leader's SIGKILL
/// leaves a quorum that elects another, the cluster keeps serving, and the supervisor starts
/// the member again on its data, where it rejoins as a follower.
#[test]
fn three_etcd_members_outlive_their_leader() -> TestResult {
    let dir = common::temp_dir("tandem-supervise-etcd-members")?;
    let ttl = LEASE_TTL.as_secs().to_string();
    let mut up = Up::start(
        &dir,
        &[
            "--etcd-members",
            "3",
            "--prefill",
            "0",
            "--restart-backoff-ms",
            &RESTART_BACKOFF_MS.to_string(),
            "--lease-ttl-s",
            &ttl,
        ],
    )?;
    let result = (|| -> TestResult {
        let members: Vec<_> = up.components()?.iter().filter(|c| c.role == Role::Etcd).cloned().collect();
        let names: Vec<&str> = members.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["etcd-0", "etcd-1", "etcd-2"], "{:?}", up.state);
        let client = |c: &facts::state::Component| c.grpc.clone().ok_or_else(|| format!("no client address: {c:?}"));
        let leaders = || -> Result<Vec<String>, String> {
            let mut v = Vec::new();
            for c in &members {
                if metric(&client(c)?, "etcd_server_is_leader", &[]).unwrap_or(0.0) == 1.0 {
                    v.push(c.name.clone());
                }
            }
            Ok(v)
        };
        let leader = wait_for(Duration::from_secs(30), "one etcd leader", || {
            let l = leaders()?;
            Ok((l.len() == 1).then(|| l[0].clone()))
        })?;
        let http = up.http()?;
        let chat = || {
            common::post(
                &http,
                "/v1/completions",
                r#"{"model":"SmolLM2-135M-Instruct","prompt":"The capital of France is","max_tokens":4,"temperature":0}"#,
            )
        };
        assert_eq!(chat()?.0, 200);

        let decode_pid = up.component("decode-0")?.pid;
        let old = up.component(&leader)?.pid;
        kill9(old)?;
        let killed = tokio::time::Instant::now();
        let next = wait_for(Duration::from_secs(30), "another etcd leader", || {
            let l = leaders()?;
            Ok(l.iter().find(|n| **n != leader).cloned())
        })?;
        let (status, body) = chat()?;
        assert_eq!(status, 200, "served with {leader} dead and {next} leading: {body}");
        up.reload()?;
        assert_eq!(up.component(&leader)?.pid, old, "{leader} was still down (not restarted) when that was served");
        back(&mut up, &leader, old, 1)?;
        let c = up.component(&leader)?;
        assert_eq!(c.last_exit.as_deref(), Some("signal 9 (SIGKILL)"), "{c:?}");
        // Back on its own data as a member again: healthy, and it knows a leader.
        wait_for(Duration::from_secs(30), &format!("{leader} rejoined"), || {
            let healthy = common::get(&client(&c)?, "/health").is_ok_and(|(s, _)| s == 200);
            let has_leader = metric(&client(&c)?, "etcd_server_has_leader", &[]).unwrap_or(0.0) == 1.0;
            Ok((healthy && has_leader).then_some(()))
        })?;
        assert_eq!(chat()?.0, 200);
        // The decode worker kept its lease alive through the other members (it was told every
        // one): two lease TTLs after the kill it is the same process, still counted serving.
        wait_for(Duration::from_secs(30), "two lease TTLs past the leader's death", || {
            Ok((killed.elapsed() > 2 * LEASE_TTL).then_some(()))
        })?;
        serving(&http, "decode", 1.0, Duration::from_secs(1))?;
        up.reload()?;
        let d = up.component("decode-0")?;
        assert!(d.pid == decode_pid && d.restarts == 0 && running(d.pid), "{d:?}");
        Ok(())
    })();
    finish(up, &dir, result)
}

/// `tandem drain NAME --state-file F` drains one worker of a running cluster by its name:
/// a request running on it completes, the command reports the worker's clean exit and its
/// supervisor's restart, and the worker serves again; an unknown name and an etcd member
/// are refused, naming why.
#[test]
fn tandem_drain_drains_a_worker_by_name_and_follows_its_restart() -> TestResult {
    let dir = common::temp_dir("tandem-drain")?;
    let mut up = Up::start(&dir, &["--restart", "always", "--restart-backoff-ms", "300", "--lease-ttl-s", "2"])?;
    let result = (|| -> TestResult {
        let http = up.http()?;
        let state = up.state_file.to_string_lossy().into_owned();
        let drain = |args: &[&str]| {
            std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
                .arg("drain")
                .args(args)
                .args(["--state-file", &state])
                .output()
        };
        let refused = drain(&["decode-9"])?;
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && err.contains("decode-0"), "an unknown name lists the known: {err}");
        let refused = drain(&["etcd"])?;
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && err.contains("etcd member"), "{err}");

        let old = up.component("decode-0")?;
        let metrics = old.metrics.clone().ok_or("decode-0 has no metrics address")?;
        // A request long enough to be running when the drain starts (the prompt is prefilled
        // on the decode worker: short).
        let body =
            r#"{"model":"SmolLM2-135M-Instruct","prompt":"Count from one to fifty:","max_tokens":64,"temperature":0}"#;
        let inflight = {
            let http = http.clone();
            std::thread::spawn(move || common::post(&http, "/v1/completions", body))
        };
        wait_for(Duration::from_secs(60), "the request running on decode-0", || {
            let n = metric(&metrics, facts::metrics::worker::REQUESTS_RUNNING, &[])?;
            Ok((n >= 1.0).then_some(()))
        })?;
        let out = drain(&["decode-0"])?;
        let (said, err) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "tandem drain failed: {err}");
        assert!(err.contains(&format!("decode-0 (pid {}): asked to drain", old.pid)), "{err}");
        assert!(
            said.contains(&format!("decode-0 (pid {}) drained in", old.pid)) && said.contains("exit status 0"),
            "{said}"
        );
        assert!(said.contains("decode-0 restarted by its supervisor as pid"), "{said}");
        let (status, text) = inflight.join().map_err(|_| "the request's thread panicked")??;
        assert_eq!(status, 200, "the request running through the drain completes: {text}");

        up.reload()?;
        let new = up.component("decode-0")?;
        assert!(new.pid != old.pid && new.state == State::Running && new.restarts == old.restarts + 1, "{new:?}");
        assert!(!running(old.pid), "the drained process is gone");
        assert_eq!(new.last_exit.as_deref(), Some("exit status 0"), "{new:?}");
        serving(&http, "decode", 1.0, BACK_WITHIN)?;
        let (status, text) = common::post(&http, "/v1/completions", body)?;
        assert_eq!(status, 200, "served after the drain: {text}");
        Ok(())
    })();
    finish(up, &dir, result)
}
