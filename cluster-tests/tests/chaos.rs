//! `tandem chaos` as CI runs it: one fixed seed, a minute of overlapping faults
//! of every kind under steady load on a cluster of real processes, and not
//! one invariant broken — every request complete with its undisturbed answer
//! or failed typed within its deadline, KV back to zero, clean shutdown.
//!
//! Needs the workspace binaries (`cargo build --workspace --bins`), the model
//! (`make model`) and etcd on PATH.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::collections::BTreeSet;
use std::time::Duration;

use drills::chaos::{run_chaos, ChaosOptions, FaultKind, ScheduleOptions};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minute_of_seeded_chaos_breaks_no_invariant() -> TestResult {
    let o = ChaosOptions {
        schedule: ScheduleOptions {
            seed: 7,
            duration: Duration::from_secs(60),
            per_minute: 8.0,
            kinds: FaultKind::ALL.to_vec(),
            exclude: Vec::new(),
            max_in_flight: 2,
        },
        load_rps: 1.0,
        keep_logs: false,
        journal: None,
        cancel: Default::default(),
    };
    let r = run_chaos(&o).await?;
    eprintln!(
        "chaos seed {}: applied {:?}, {} requests, {} complete, typed {:?}, {} resumed; repeat: {}",
        r.seed, r.applied, r.requests, r.complete, r.typed_errors, r.resumed, r.command
    );
    for a in &r.actions {
        eprintln!("  {:>7} ms {:<5} {:<17} {} {}", a.at_ms, a.what, a.kind.name(), a.target, a.error);
    }
    assert!(r.violations.is_empty(), "{:#?}", r.violations);
    assert!(r.actions.iter().all(|a| a.error.is_empty()), "every fault applied and lifted: {:#?}", r.actions);
    let kinds: BTreeSet<&str> = r.applied.keys().copied().collect();
    assert!(r.applied.values().sum::<u32>() >= 8 && kinds.len() >= 5, "faults of many kinds: {:?}", r.applied);
    assert_eq!(r.requests, 60, "the whole load ran");
    assert!(r.complete + r.typed_errors.values().sum::<u32>() as usize == r.requests);
    Ok(())
}
