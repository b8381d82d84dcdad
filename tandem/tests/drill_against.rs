//! `tandem drill --against STATEFILE` runs drills against a cluster `tandem
//! up` started and leaves it running as found: reversible faults (SIGSTOP),
//! and faults that end a worker (SIGKILL, a drain) which `tandem up`'s
//! supervisor undoes, when its restart policy restarts that exit. A drill
//! that cannot run there is refused with the reason, and nothing is touched.
//! The state file gives the workers' lease TTL, each process's log and the
//! restart policy, and the drills scan those logs for panics (G5).
//!
//! Real processes: `tandem up` (etcd, prefill and decode workers, a
//! coordinator) and `tandem drill`, both this crate's binary.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;

use common::{proc_state, running, Component, Role, StateFile, TestResult, Up, WAIT};
use facts::state::State;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

fn get_status(addr: &str, path: &str) -> Result<u16, String> {
    common::get(addr, path).map(|(status, _)| status).map_err(|e| e.to_string())
}

/// Requests the coordinator at `http` has finished ([`facts::metrics::coordinator::REQUESTS`], every
/// label set); an error when it exports none.
fn finished_requests(http: &str) -> Result<f64, String> {
    let page = opskit::prom::scrape_blocking(http).map_err(|e| e.to_string())?;
    page.sum(facts::metrics::coordinator::REQUESTS, &[]).map_err(|e| e.to_string())
}

/// `tandem ARGS`, killed if it runs past `limit`.
fn tandem(args: &[&str], limit: Duration) -> Result<Output, String> {
    tandem_while(args, limit, || Ok(()))
}

/// `tandem ARGS`, killed if it runs past `limit`; `meanwhile` runs once it has started.
fn tandem_while(
    args: &[&str],
    limit: Duration,
    meanwhile: impl FnOnce() -> Result<(), String>,
) -> Result<Output, String> {
    let child = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| e.to_string())?;
    let pid = child.id();
    if let Err(e) = meanwhile() {
        let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
        return Err(e);
    }
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || drop(tx.send(child.wait_with_output())));
    match rx.recv_timeout(limit) {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(_) => {
            let _ = Command::new("kill").args(["-KILL", &pid.to_string()]).status();
            Err(format!("tandem {args:?} did not finish within {limit:?}"))
        }
    }
}

/// The table row `tandem drill` printed for drill `name`.
fn row<'a>(stdout: &'a str, name: &str) -> Result<&'a str, String> {
    stdout.lines().find(|l| l.starts_with(name)).ok_or_else(|| format!("no row for {name}: {stdout}"))
}

/// Each of `names` ran and was proven (its row's second column `yes`).
fn assert_proven(stdout: &str, names: &[&str]) -> TestResult {
    for name in names {
        let row = row(stdout, name)?;
        assert_eq!(row.split_whitespace().nth(1), Some("yes"), "{name} proven: {row}");
    }
    Ok(())
}

/// Stops `tandem up` after a test's body, removes its directory, and requires the body's
/// success and a clean exit (0 on SIGTERM).
fn finish(mut up: Up, dir: &std::path::Path, result: TestResult) -> TestResult {
    let stopped = up.stop();
    let _ = std::fs::remove_dir_all(dir);
    result?;
    let status = stopped?;
    assert!(status.success(), "tandem up exit after the drills: {status:?}");
    Ok(())
}

#[test]
fn drills_run_against_a_running_cluster_and_leave_it_running() -> TestResult {
    let dir = common::temp_dir("tandem-drill-against")?;
    let up = Up::start(&dir, &["--decode", "2", "--lease-ttl-s", "4"])?;
    let state = up.state_file.clone();
    let result = (|| -> TestResult {
        let v = &up.state;
        let comps = up.components()?;
        let pids: Vec<(Role, u32)> = comps.iter().map(|c| (c.role, c.pid)).collect();
        for c in comps.iter().filter(|c| matches!(c.role, Role::Prefill | Role::Decode)) {
            assert_eq!(c.version_group.as_deref(), Some("local"), "workers' version group in the state file: {c:?}");
            assert_eq!(c.lease_ttl_s, Some(4), "workers' lease TTL in the state file: {c:?}");
        }
        // Every process's output goes to its own file; by default in `STATEFILE.logs`.
        let log_dir = dir.join("state.json.logs");
        let mut logs = Vec::new();
        for c in comps {
            let log = c.log.clone().ok_or_else(|| format!("no log in {c:?}"))?;
            assert!(log.is_file(), "{} is not a file: {c:?}", log.display());
            if c.role != Role::Etcd {
                assert_eq!(log.parent(), Some(log_dir.as_path()), "{c:?}");
            }
            logs.push(log);
        }
        logs.sort();
        logs.dedup();
        assert_eq!(logs.len(), comps.len(), "one log per process: {logs:?}");
        let decode0 = log_dir.join("decode-0.log");
        let text = std::fs::read_to_string(&decode0)?;
        assert!(text.contains("listening "), "decode-0's stdout is in {}: {text}", decode0.display());
        let http = up.http()?;
        let http = http.as_str();
        let state_s = state.to_str().ok_or("state path")?;
        let all_running = |when: &str| {
            for (role, pid) in &pids {
                assert!(running(*pid), "{when}: {role:?} (pid {pid}) is not running: {:?}", proc_state(*pid));
            }
        };

        // A drill that needs a cluster shaped for it (its KV proxy in a worker's namespace) is refused, and
        // so is a drain under the default policy (`on-failure` leaves a worker that exited 0
        // down), each with the reason; nothing is touched.
        assert_eq!(v.restart.as_deref(), Some("on-failure"), "the default policy in the state file");
        let refused = tandem(&["drill", "--against", state_s, "run", "kv-delay", "rolling-drain"], WAIT)?;
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "kv-delay and rolling-drain must be refused: {err}");
        let kv = err.lines().find(|l| l.contains("kv-delay:")).ok_or_else(|| format!("no reason: {err}"))?;
        assert!(kv.contains("proxy") && kv.contains("network namespace") && kv.contains("--hosts"), "{kv}");
        let drain = err.lines().find(|l| l.contains("rolling-drain:")).ok_or_else(|| format!("no reason: {err}"))?;
        assert!(drain.contains("--restart on-failure") && drain.contains("--restart always"), "the reason: {drain}");
        all_running("after the refused drills");

        let ran = tandem(&["drill", "--against", state_s, "run", "client-disconnect", "worker-sigstop"], WAIT)?;
        let (stdout, stderr) = (String::from_utf8_lossy(&ran.stdout), String::from_utf8_lossy(&ran.stderr));
        assert!(ran.status.success(), "tandem drill --against failed:\n{stdout}\n{stderr}");
        assert_proven(&stdout, &["client-disconnect", "worker-sigstop"])?;
        all_running("after the drills");
        assert_eq!(get_status(http, "/ready")?, 200, "the cluster still serves after the drills");

        // The logs are scanned, from where they stood when the drill attached: the same
        // cluster with decode-0's log swapped for a copy (the live log is left alone). A
        // panic already in it passes; one written during the drill fails G5, naming it.
        let panicked = dir.join("decode-0-panicked.log");
        let panic_line =
            "thread 'tokio-runtime-worker' panicked at worker/src/injected.rs:1:1:\ninjected by the test\n";
        std::fs::write(&panicked, format!("{text}{panic_line}"))?;
        let mut v2 = v.clone();
        for c in &mut v2.components {
            if c.log.as_deref() == Some(decode0.as_path()) {
                c.log = Some(panicked.clone());
            }
        }
        assert_ne!(&v2, v, "decode-0's log was swapped");
        let state2 = dir.join("state-panicked.json");
        v2.write(&state2)?;
        let state2_s = state2.to_str().ok_or("path")?;
        let ran = tandem(&["drill", "--against", state2_s, "run", "client-disconnect"], WAIT)?;
        let stdout = String::from_utf8_lossy(&ran.stdout);
        assert!(ran.status.success(), "a panic from before the drill attached is not this drill's:\n{stdout}");

        let before = finished_requests(http)?;
        let ran = tandem_while(&["drill", "--against", state2_s, "run", "client-disconnect"], WAIT, || {
            // The drill's load has begun (so it attached and took the logs' lengths): panic now.
            let t0 = std::time::Instant::now();
            while finished_requests(http)? <= before {
                if t0.elapsed() > WAIT {
                    return Err(format!("the drill finished no request within {WAIT:?}"));
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let mut f = std::fs::OpenOptions::new().append(true).open(&panicked).map_err(|e| e.to_string())?;
            f.write_all(panic_line.as_bytes()).map_err(|e| e.to_string())
        })?;
        let stdout = String::from_utf8_lossy(&ran.stdout);
        assert!(!ran.status.success(), "a panic logged during the drill must fail it:\n{stdout}");
        let g5 = stdout
            .lines()
            .find(|l| l.trim_start().starts_with("G5:") && l.contains("decode-0 panicked"))
            .ok_or_else(|| format!("no G5 violation naming decode-0's panic:\n{stdout}"))?;
        assert!(g5.contains(panicked.to_str().ok_or("path")?), "it names the log: {g5}");
        all_running("after the drill that found the panic");
        Ok(())
    })();
    // `tandem up` exits 0 on SIGTERM only if no child had exited on its own before.
    finish(up, &dir, result)
}

/// A supervised cluster (`--restart always`, short lease and backoff): a SIGKILLed decode
/// worker and every drained worker is started again by `tandem up`, the drills wait for it
/// and follow the new pids, and the cluster is left with the same components, running.
#[test]
fn drills_that_end_a_worker_run_against_a_supervised_cluster() -> TestResult {
    let dir = common::temp_dir("tandem-drill-against-supervised")?;
    let args = ["--prefill", "2", "--decode", "2", "--restart", "always", "--lease-ttl-s", "2"];
    let mut up = Up::start(&dir, &[&args[..], &["--restart-backoff-ms", "300"]].concat())?;
    let state = up.state_file.clone();
    let result = (|| -> TestResult {
        let before: Vec<(String, u32)> = up.components()?.iter().map(|c| (c.name.clone(), c.pid)).collect();
        let state_s = state.to_str().ok_or("state path")?;
        let drills = ["decode-kill", "rolling-drain", "worker-sigstop"];
        let t0 = std::time::Instant::now();
        let ran =
            tandem(&[&["drill", "--against", state_s, "--requests", "10", "run"][..], &drills].concat(), WAIT * 2)?;
        let (stdout, stderr) = (String::from_utf8_lossy(&ran.stdout), String::from_utf8_lossy(&ran.stderr));
        eprintln!("the drills took {:?}:\n{stdout}", t0.elapsed());
        assert!(ran.status.success(), "tandem drill --against failed:\n{stdout}\n{stderr}\n{}", up.stderr_text());
        assert_proven(&stdout, &drills)?;

        // Left as found: the same components, each running, the workers under new pids.
        up.reload()?;
        let after = up.components()?;
        let names: Vec<&str> = after.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, before.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(), "the same components");
        let mut decode_restarts = 0;
        for ((name, old_pid), c) in before.iter().zip(after) {
            let pid = c.pid;
            assert_eq!(c.state, State::Running, "{c:?}");
            assert!(running(pid), "{name} (pid {pid}) is not running: {:?}", proc_state(pid));
            let restarts = c.restarts;
            match c.role {
                Role::Prefill | Role::Decode => {
                    // Every worker was drained once (rolling-drain); a decode worker also killed.
                    assert!(restarts >= 1 && pid != *old_pid, "{name} was restarted: {c:?}");
                    if c.role == Role::Decode {
                        decode_restarts += restarts;
                    }
                    let log = std::fs::read_to_string(c.log.as_ref().ok_or("log")?)?;
                    assert!(log.contains("===== tandem up: restart 1 of"), "{name}'s log has a separator: {log}");
                }
                _ => assert_eq!((restarts, pid), (0, *old_pid), "{name} was not touched: {c:?}"),
            }
        }
        assert!(decode_restarts >= 3, "2 decode workers drained and one killed: {after:?}");
        assert_eq!(get_status(&up.http()?, "/ready")?, 200, "the cluster still serves after the drills");
        Ok(())
    })();
    finish(up, &dir, result)
}

/// A cluster started by hand, not by `tandem up` (plain processes, each started by its own
/// script in the background, no supervisor), described by a state file written here whose
/// command templates log each action before doing it. The drills act on it only through
/// those templates: SIGSTOP/SIGCONT for worker-sigstop; for decode-kill, SIGKILL and then
/// the `restart` template (the start script again, which prints the new pid), whose pid the
/// drill writes back into the state file. A drain drill is refused: only a supervisor that
/// reaped a worker can prove it exited 0. `--vacuity` runs against the same cluster.
#[test]
fn action_templates_drive_a_cluster_started_by_hand() -> TestResult {
    use facts::argv::{WorkerArgv, COORDINATOR_BINARY};
    use facts::state::Action;

    let dir = common::temp_dir("tandem-drill-templates")?;
    let bin_dir = std::path::Path::new(env!("CARGO_BIN_EXE_tandem")).parent().ok_or("bin dir")?.to_owned();
    let model = std::env::var("TANDEM_MODEL").map_err(|_| "TANDEM_MODEL is not set (make model)")?;
    let ports = opskit::process::free_ports(12)?;
    let at = |i: usize| format!("127.0.0.1:{}", ports[i]);
    let etcd_bin = std::env::var("TANDEM_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
    let etcd_args = vec![
        "--name=hand".to_owned(),
        format!("--data-dir={}", dir.join("etcd-data").display()),
        format!("--listen-client-urls=http://{}", at(0)),
        format!("--advertise-client-urls=http://{}", at(0)),
        format!("--listen-peer-urls=http://{}", at(1)),
        format!("--initial-advertise-peer-urls=http://{}", at(1)),
        format!("--initial-cluster=hand=http://{}", at(1)),
    ];
    let prefix = format!("tandem-hand-{}", std::process::id());
    let p0_argv = WorkerArgv::prefill()
        .model(&model)
        .version_group("local")
        .threads(1)
        .shutdown_timeout_ms(5000)
        .etcd(&at(0))
        .cluster_prefix(&prefix)
        .lease_ttl_s(2)
        .worker_id("prefill-0");
    let p0_bin = p0_argv.binary();
    let p0_args = p0_argv.grpc(&at(2)).metrics(&at(3)).build();
    let decode = |name: &str, grpc: String, metrics: String, transfer: String| {
        let argv = WorkerArgv::decode()
            .model(&model)
            .version_group("local")
            .threads(1)
            .shutdown_timeout_ms(5000)
            .etcd(&at(0))
            .cluster_prefix(&prefix)
            .lease_ttl_s(2)
            .worker_id(name)
            .transfer(&transfer)
            .kv_load_failure_policy("recompute")
            .grpc(&grpc)
            .metrics(&metrics);
        (name.to_owned(), argv.binary(), argv.build())
    };
    let d0 = decode("decode-0", at(4), at(5), at(6));
    let d1 = decode("decode-1", at(7), at(8), at(9));
    // A tenants file, so every request needs a key: the drills' own tenant (`--api-key`).
    let tenants = dir.join("tenants.toml");
    std::fs::write(&tenants, "[tenants.drills]\nkeys = [\"sk-drills\"]\n")?;
    let tenants_s = tenants.display().to_string();
    let coordinator_args: Vec<String> = ["--model", &model, "--etcd", &at(0), "--cluster-prefix", &prefix]
        .iter()
        .map(|s| s.to_string())
        .chain(["--shutdown-timeout-ms".into(), "5000".into(), "--http".into(), at(10)])
        .chain(["--grpc".into(), at(11), "--tenants".into(), tenants_s.clone()])
        .collect();

    // Each component's start script: starts it in the background, its output appended to its
    // log, and prints its pid. The `restart` template runs the same script.
    let actions_log = dir.join("actions.log");
    let start_script = |name: &str, program: &str, args: &[String]| -> Result<PathBuf, std::io::Error> {
        let words: Vec<String> = std::iter::once(program.to_owned())
            .chain(args.iter().cloned())
            .map(|w| facts::state::shell_word(&w))
            .collect();
        let log = dir.join(format!("{name}.log"));
        let script = dir.join(format!("start-{name}.sh"));
        std::fs::write(
            &script,
            format!(
                "setsid {} >> {} 2>&1 < /dev/null &\necho $!\n",
                words.join(" "),
                facts::state::shell_word(&log.display().to_string())
            ),
        )?;
        Ok(script)
    };
    let bin = |b: &str| bin_dir.join(b).display().to_string();
    let specs: Vec<(Role, String, String, Vec<String>)> = vec![
        (Role::Etcd, "etcd".into(), etcd_bin, etcd_args),
        (Role::Prefill, "prefill-0".into(), bin(p0_bin), p0_args),
        (Role::Decode, d0.0.clone(), bin(d0.1), d0.2.clone()),
        (Role::Decode, d1.0.clone(), bin(d1.1), d1.2.clone()),
        (Role::Coordinator, "coordinator".into(), bin(COORDINATOR_BINARY), coordinator_args),
    ];
    let state_path = dir.join("state.json");
    let mut file = StateFile { restart: None, components: Vec::new() };
    let guard = HandCluster {
        state: state_path.clone(),
        dir: dir.clone(),
        started: Default::default(),
        failed: Default::default(),
    };
    let log_action = |what: &str, then: &str| {
        format!("echo {what} {{name}} >> {} && {then}", facts::state::shell_word(&actions_log.display().to_string()))
    };
    let result = (|| -> TestResult {
        for (role, name, program, args) in &specs {
            let script = start_script(name, program, args)?;
            let out = Command::new("sh").arg(&script).output()?;
            let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse()?;
            let mut c = Component::new(*role, name);
            c.pid = pid;
            c.log = Some(dir.join(format!("{name}.log")));
            let (i0, keys): (usize, &[&str]) = match name.as_str() {
                "etcd" => (0, &["grpc"]),
                "prefill-0" => (2, &["grpc", "metrics"]),
                "decode-0" => (4, &["grpc", "metrics", "transfer"]),
                "decode-1" => (7, &["grpc", "metrics", "transfer"]),
                _ => (10, &["http"]),
            };
            for (k, key) in keys.iter().enumerate() {
                *c.addr_mut(facts::state::Addr::from_key(key).ok_or("key")?) = Some(at(i0 + k));
            }
            if *role == Role::Coordinator {
                c.metrics = c.http.clone();
                c.grpc = Some(at(11));
                c.flags.insert(facts::state::flag::TENANTS.into(), tenants_s.clone());
            }
            if matches!(role, Role::Prefill | Role::Decode) {
                c.version_group = Some("local".into());
                c.lease_ttl_s = Some(2);
            }
            c.actions = [
                (Action::Kill, log_action("kill", "kill -KILL {pid}")),
                (Action::Stop, log_action("stop", "kill -STOP {pid}")),
                (Action::Cont, log_action("cont", "kill -CONT {pid}")),
                (Action::Term, log_action("term", "kill -TERM {pid}")),
                (Action::Restart, log_action("restart", &format!("sh {}", script.display()))),
            ]
            .into_iter()
            .collect();
            guard.started.lock().unwrap_or_else(|e| e.into_inner()).push(c.clone());
            file.components.push(c);
            file.write(&state_path)?;
            if *role == Role::Etcd {
                // The workers register at start: etcd answers first.
                common::wait_for(WAIT, "etcd answers /health", || {
                    Ok((get_status(&at(0), "/health").ok() == Some(200)).then_some(()))
                })?;
            }
        }
        common::serving(&at(10), "decode", 2.0, WAIT)?;
        common::serving(&at(10), "prefill", 1.0, WAIT)?;
        let state_s = state_path.to_str().ok_or("state path")?;
        let before: Vec<(String, u32)> = file.components.iter().map(|c| (c.name.clone(), c.pid)).collect();

        let key = ["--api-key", "sk-drills"];
        let refused = tandem(&["drill", "--against", state_s, "run", "worker-sigstop"], WAIT)?;
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && err.contains(&tenants_s) && err.contains("--api-key"), "no key: {err}");
        let refused = tandem(&["drill", "--against", state_s, "--api-key", "sk-drills", "run", "rolling-drain"], WAIT)?;
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "rolling-drain must be refused: {err}");
        assert!(err.contains("rolling-drain:") && err.contains("exited 0"), "the reason: {err}");
        assert!(!actions_log.exists(), "a refused drill acts on nothing");

        let drills = ["worker-sigstop", "decode-kill"];
        let ran = tandem(
            &[&["drill", "--against", state_s, "--requests", "10"][..], &key, &["run"], &drills].concat(),
            WAIT * 2,
        )?;
        let (stdout, stderr) = (String::from_utf8_lossy(&ran.stdout), String::from_utf8_lossy(&ran.stderr));
        assert!(ran.status.success(), "tandem drill --against failed:\n{stdout}\n{stderr}");
        assert_proven(&stdout, &drills)?;
        eprintln!("{stdout}");
        // Every fault went through a template, and the killed worker was restarted by its own.
        let acted = std::fs::read_to_string(&actions_log)?;
        let lines: Vec<&str> = acted.lines().collect();
        let killed = lines
            .iter()
            .find_map(|l| l.strip_prefix("kill "))
            .ok_or_else(|| format!("no kill action: {acted}"))?
            .to_owned();
        assert!(killed.starts_with("decode-"), "decode-kill kills a decode worker: {acted}");
        let stopped = lines.iter().find_map(|l| l.strip_prefix("stop ")).ok_or_else(|| format!("no stop: {acted}"))?;
        assert!(lines.contains(&format!("cont {stopped}").as_str()), "the stopped worker was continued: {acted}");
        assert!(lines.contains(&format!("restart {killed}").as_str()), "the killed worker was restarted: {acted}");

        let after = StateFile::read(&state_path)?;
        for (name, old) in &before {
            let c = after.component(name).ok_or_else(|| format!("{name} left the state file: {after:?}"))?;
            assert!(running(c.pid), "{name} (pid {}) runs after the drills: {:?}", c.pid, proc_state(c.pid));
            if *name == killed {
                assert!(c.pid != *old && c.restarts == 1 && c.state == State::Running, "{name} restarted: {c:?}");
            } else {
                assert_eq!((c.pid, c.restarts), (*old, 0), "{name} was not restarted: {c:?}");
            }
        }

        // Chaos against the same cluster: the kinds it cannot apply here are refused with
        // why (one prefill worker, one coordinator and no KV proxy), the rest act through
        // the templates, and a killed decode worker comes back by its restart template.
        let chaos = ["chaos", "--against", state_s, "--seed", "5", "--duration", "20s", "--rate", "12"];
        let faults = ["--faults", "kill-decode,stop-decode,stop-etcd,kill-prefill,kv-delay,disconnect"];
        let keyless = tandem(&[&chaos[..], &faults, &["--dry-run"]].concat(), WAIT)?;
        let err = String::from_utf8_lossy(&keyless.stderr);
        assert!(!keyless.status.success() && err.contains("--api-key"), "chaos without a key: {err}");
        let chaos = [&chaos[..], &key].concat();
        let dry = tandem(&[&chaos[..], &faults, &["--dry-run"]].concat(), WAIT)?;
        let (plan, err) = (String::from_utf8_lossy(&dry.stdout), String::from_utf8_lossy(&dry.stderr));
        assert!(dry.status.success(), "chaos --dry-run against the cluster:\n{plan}\n{err}");
        for refused in ["kill-prefill: needs at least 2 prefill workers", "kv-delay: it acts through a fault proxy"] {
            assert!(err.contains(&format!("not against this cluster: {refused}")), "{refused}: {err}");
        }
        assert!(plan.contains("kill-decode") && !plan.contains("kv-delay"), "the schedule: {plan}");
        let restarts_before = std::fs::read_to_string(&actions_log)?.matches("restart decode-").count();
        let ran = tandem(&[&chaos[..], &faults].concat(), WAIT)?;
        let (out, err) = (String::from_utf8_lossy(&ran.stdout), String::from_utf8_lossy(&ran.stderr));
        eprintln!("{out}");
        assert!(ran.status.success(), "chaos against the cluster:\n{out}\n{err}");
        assert!(out.contains("no invariant broke"), "{out}");
        let acted = std::fs::read_to_string(&actions_log)?;
        assert!(
            acted.matches("restart decode-").count() > restarts_before,
            "chaos's kill came back by template: {acted}"
        );
        common::serving(&at(10), "decode", 2.0, WAIT)?;

        // The same cluster with every fault skipped: the proof must fail, and that passes.
        let vacuity = ["drill", "--against", state_s, "--api-key", "sk-drills", "--requests", "6", "--vacuity"];
        let ran = tandem(&[&vacuity[..], &["run", "worker-sigstop"]].concat(), WAIT)?;
        let stdout = String::from_utf8_lossy(&ran.stdout);
        assert!(ran.status.success(), "worker-sigstop --vacuity against the cluster:\n{stdout}");
        let row =
            stdout.lines().find(|l| l.starts_with("worker-sigstop")).ok_or_else(|| format!("no row: {stdout}"))?;
        assert!(row.contains("no (ok)"), "the skipped fault is not proven: {row}");
        assert_eq!(std::fs::read_to_string(&actions_log)?, acted, "a vacuity run acts on nothing");
        assert_eq!(get_status(&at(10), "/ready")?, 200, "the cluster still serves after the drills");
        Ok(())
    })();
    guard.failed.store(result.is_err(), std::sync::atomic::Ordering::SeqCst);
    drop(guard);
    result
}

/// Stops a cluster started by hand when dropped, also when the test panics: SIGKILL to every
/// pid its state file lists now (a restarted worker under its new pid) and every pid it was
/// started as, with the end of each log printed on a failure; then its directory goes.
struct HandCluster {
    state: PathBuf,
    dir: PathBuf,
    started: std::sync::Mutex<Vec<Component>>,
    failed: std::sync::atomic::AtomicBool,
}

impl Drop for HandCluster {
    fn drop(&mut self) {
        let started = std::mem::take(&mut *self.started.lock().unwrap_or_else(|e| e.into_inner()));
        let listed = StateFile::read(&self.state).map(|f| f.components).unwrap_or_default();
        let failed = std::thread::panicking() || self.failed.load(std::sync::atomic::Ordering::SeqCst);
        for c in listed.iter().chain(&started).rev() {
            let _ = Command::new("kill").args(["-KILL", &c.pid.to_string()]).stderr(Stdio::null()).status();
        }
        if failed {
            for c in &listed {
                let log = c.log.as_ref().and_then(|l| std::fs::read_to_string(l).ok()).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                eprintln!("--- {} (pid {}) log tail ---\n{}", c.name, c.pid, tail.join("\n"));
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `tandem up --hosts 4 --coordinator-hosts --etcd-members 3`, a tenants file and a policy per
/// decode worker: the link drills act through each worker's
/// `link-fault` template inside its host namespace (a KV blackhole on decode-0, decode-1
/// cut off from etcd, `ss -K` on decode-0's control link), the etcd drills on the three supervised members (the leader killed
/// and started again, every member stopped; two of three stopped past the coordinators'
/// registry bound), the KV-proxy drills (the drill's proxy in decode-0's namespace), the
/// coordinator drills on `--coordinators 2` (the drill's own front before them), each
/// proven, and several failing their proof with `--vacuity`; the cluster is left as found:
/// same components running, no rule left in any namespace.
#[test]
fn link_and_etcd_drills_run_against_hosts_and_three_etcd_members() -> TestResult {
    let dir = common::temp_dir("tandem-drill-against-hosts")?;
    // A tenant of the drills' own: with a tenants file every request needs a key.
    let tenants = dir.join("tenants.toml");
    std::fs::write(&tenants, "[tenants.drills]\nkeys = [\"sk-drills\"]\n")?;
    let tenants_s = tenants.to_str().ok_or("tenants path")?;
    let args = [
        "--hosts",
        "4",
        "--coordinator-hosts",
        "--prefill",
        "2",
        "--kv-load-failure-policy",
        "recompute,retry",
        "--tenants",
        tenants_s,
        "--etcd-members",
        "3",
        "--decode",
        "2",
        "--coordinators",
        "2",
        "--restart",
        "always",
        "--lease-ttl-s",
        "2",
    ];
    // A short lease where a drill holds decode-0's KV, a long one where decode-1 retries.
    let fit = ["--restart-backoff-ms", "300", "--reservation-ttl-ms", "3000,30000", "--registry-max-stale-ms", "12000"];
    let mut up = Up::start(&dir, &[&args[..], &fit[..]].concat())?;
    let state = up.state_file.clone();
    let result = (|| -> TestResult {
        let state_s = state.to_str().ok_or("state path")?;
        // kv-resets and kv-delay: the drill's KV proxy in decode-0's namespace, its port redirected there.
        // Every drill's traffic carries the drills' key.
        let key = ["--api-key", "sk-drills"];
        let refused = tandem(&["drill", "--against", state_s, "run", "kv-delay"], WAIT)?;
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success() && err.contains("--api-key") && err.contains(tenants_s), "{err}");
        let drills = [
            "kv-blackhole",
            "kv-resets",
            "kv-delay",
            "worker-etcd-cutoff",
            "control-link-resets",
            "etcd-leader-kill",
            "etcd-stall",
            "etcd-quorum-loss",
            // The drill's own front before the two coordinators tandem up started.
            "coordinator-kill",
            "coordinator-rolling-drain",
            // The coordinator alone on its host (--coordinator-hosts): its etcd link cut there.
            "coordinator-etcd-cutoff",
            // The proxy on decode-1's link: the decode worker whose policy is retry.
            "prefill-kill-retry",
            // A tc token bucket on decode-0's KV ingress (an IFB in its namespace).
            "kv-bandwidth",
        ];
        let ran = tandem(&[&["drill", "--against", state_s][..], &key, &["run"], &drills].concat(), WAIT * 3)?;
        let (stdout, stderr) = (String::from_utf8_lossy(&ran.stdout), String::from_utf8_lossy(&ran.stderr));
        eprintln!("{stdout}");
        assert!(ran.status.success(), "tandem drill --against failed:\n{stdout}\n{stderr}\n{}", up.stderr_text());
        assert_proven(&stdout, &drills)?;
        let vac = ["kv-blackhole", "kv-resets", "worker-etcd-cutoff"];
        // Refused with the setting that stands in the way, read from the state file.
        let refused =
            tandem(&[&["drill", "--against", state_s][..], &key, &["run", "prefill-kill-fail"]].concat(), WAIT)?;
        let err = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "prefill-kill-fail on a recompute cluster must be refused: {err}");
        assert!(err.contains("kv-load-failure-policy") && err.contains("recompute"), "{err}");
        let ran =
            tandem(&[&["drill", "--against", state_s, "--vacuity"][..], &key, &["run"], &vac].concat(), WAIT * 2)?;
        let stdout = String::from_utf8_lossy(&ran.stdout);
        assert!(ran.status.success(), "--vacuity against the hosts:\n{stdout}");
        for name in vac {
            let row = row(&stdout, name)?;
            assert!(row.contains("no (ok)"), "{name} without its fault is not proven: {row}");
        }

        // Ctrl-C while kv-blackhole holds its rule on decode-0's KV port: the drill stops and
        // lifts it (the check below finds no drill rule left in any namespace).
        let ns0 = up.component("decode-0")?.netns.clone().ok_or("decode-0's netns")?;
        let drill = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["drill", "--against", state_s, "--api-key", "sk-drills", "run", "kv-blackhole"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let pid = drill.id().to_string();
        let held = common::wait_for(WAIT, "kv-blackhole's rule in decode-0's namespace", || {
            let out = Command::new("ip").args(["netns", "exec", &ns0, "iptables", "-S", "INPUT"]).output();
            let rules = out.map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).map_err(|e| e.to_string())?;
            Ok(rules.contains("tdm-kv-drill").then_some(()))
        });
        Command::new("kill").args(["-INT", &pid]).status()?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || drop(tx.send(drill.wait_with_output())));
        let out = rx.recv_timeout(Duration::from_secs(60)).map_err(|_| "the interrupted drill did not exit")??;
        held?;
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains("interrupted during kv-blackhole"), "{err}");

        up.reload()?;
        for c in up.components()? {
            assert_eq!(c.state, State::Running, "{c:?}");
            assert!(running(c.pid), "{} (pid {}) runs: {:?}", c.name, c.pid, proc_state(c.pid));
            if let Some(ns) = &c.netns {
                // The drills' rules (comments `tandem-drill-*`, `tdm-*`), the KV proxy's REDIRECT included.
                for table in ["filter", "nat"] {
                    let rules =
                        Command::new("ip").args(["netns", "exec", ns, "iptables", "-t", table, "-S"]).output()?;
                    let rules = String::from_utf8_lossy(&rules.stdout);
                    let left = rules.contains("tandem-drill") || rules.contains("tdm-");
                    assert!(!left, "{}'s {table} rules are gone from {ns}: {rules}", c.name);
                }
            }
        }
        let leaders = up.components()?.iter().filter(|c| c.role == Role::Etcd && c.restarts > 0).count();
        assert_eq!(leaders, 1, "the killed leader alone was started again: {:?}", up.components()?);
        assert_eq!(get_status(&up.http()?, "/ready")?, 200, "the cluster still serves after the drills");
        Ok(())
    })();
    finish(up, &dir, result)
}
