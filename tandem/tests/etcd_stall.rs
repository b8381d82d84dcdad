//! Static stability through `tandem up`: etcd frozen (SIGSTOP) for 8 s, four
//! times the workers' lease TTL, under a steady load. The data plane does not
//! need etcd to serve: every request completes, the coordinator's `/ready`
//! stays 200 throughout, no worker fences, and once etcd runs again the
//! workers are registered and serving as before, with no KV left in use.
//!
//! Real processes: `tandem up` (its own etcd, 1 prefill + 1 decode worker, a
//! coordinator) and the `loadgen` client over loopback.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;

use std::time::{Duration, Instant};

use common::{metric, plan, serving, wait_for, Role, TestResult, Up};
use loadgen::{Hooks, Record};

const STALL: Duration = Duration::from_secs(8);

fn signal(sig: &str, pid: u32) -> Result<(), String> {
    let ok = std::process::Command::new("kill").args([sig, &pid.to_string()]).status().map_err(|e| e.to_string())?;
    ok.success().then_some(()).ok_or_else(|| format!("kill {sig} {pid} failed"))
}

#[test]
fn a_stalled_etcd_does_not_stop_serving() -> TestResult {
    let dir = common::temp_dir("tandem-etcd-stall")?;
    let mut up = Up::start(&dir, &["--lease-ttl-s", "2"])?;
    let etcd = up.component("etcd")?.pid;
    let result = (|| -> TestResult {
        let rt = tokio::runtime::Runtime::new()?;
        let http = up.http()?;
        let workers: Vec<String> = up
            .components()?
            .iter()
            .filter(|c| matches!(c.role, Role::Prefill | Role::Decode))
            .filter_map(|c| c.metrics.clone())
            .collect();
        let fences =
            || -> Result<f64, String> { workers.iter().map(|m| metric(m, facts::metrics::worker::FENCES, &[])).sum() };
        let fences_before = fences()?;
        let (tx, mut done) = tokio::sync::mpsc::unbounded_channel::<Record>();
        let hooks = Hooks { records: Some(tx), ..Hooks::default() };
        let cancel = hooks.cancel.clone();
        let mut p = plan(&http);
        p.arrival = loadgen::Arrival::Closed { concurrency: 2 };
        let load = rt.spawn(async move { loadgen::run_with(&p, hooks).await });
        let completed = |done: &mut tokio::sync::mpsc::UnboundedReceiver<Record>, n: &mut usize| {
            while let Ok(r) = done.try_recv() {
                *n += usize::from(r.outcome.is_complete());
            }
        };
        let mut n = 0;
        wait_for(Duration::from_secs(60), "2 requests completing before the stall", || {
            completed(&mut done, &mut n);
            Ok((n >= 2).then_some(()))
        })?;

        signal("-STOP", etcd)?;
        let stalled = Instant::now();
        let before = n;
        let mut probes = 0;
        while stalled.elapsed() < STALL {
            let (status, body) = common::get(&http, "/ready").map_err(|e| e.to_string())?;
            assert_eq!(status, 200, "/ready during the etcd stall ({:?} in): {body}", stalled.elapsed());
            probes += 1;
            std::thread::sleep(Duration::from_millis(250));
        }
        completed(&mut done, &mut n);
        signal("-CONT", etcd)?;
        assert!(probes >= 20, "only {probes} /ready probes in the stall");
        assert!(n > before, "no request completed while etcd was stopped ({n} in all)");

        // etcd back: the workers are registered (their leases may have expired meanwhile) and
        // the load goes on.
        serving(&http, "prefill", 1.0, Duration::from_secs(30))?;
        serving(&http, "decode", 1.0, Duration::from_secs(30))?;
        let after = n;
        wait_for(Duration::from_secs(60), "2 more requests completing after the stall", || {
            completed(&mut done, &mut n);
            Ok((n >= after + 2).then_some(()))
        })?;
        cancel.cancel();
        let report = rt.block_on(load)??;
        let failed: Vec<_> = report.records.iter().filter(|r| !r.outcome.is_complete()).collect();
        assert!(failed.is_empty(), "every request completes through the stall: {failed:?}");
        assert_eq!(fences()?, fences_before, "a worker fenced while etcd was stalled");
        for m in &workers {
            wait_for(Duration::from_secs(30), &format!("{m} KV back to 0"), || {
                Ok((metric(m, facts::metrics::worker::KV_BLOCKS_USED, &[])? == 0.0).then_some(()))
            })?;
        }
        Ok(())
    })();
    // Never leave etcd stopped, whatever failed.
    let _ = signal("-CONT", etcd);
    let result = result.map_err(|e| format!("{e}\ntandem up's stderr:\n{}", up.stderr_text()).into());
    let status = up.stop()?;
    assert!(status.success(), "tandem up exit: {status:?}");
    let _ = std::fs::remove_dir_all(&dir);
    result
}
