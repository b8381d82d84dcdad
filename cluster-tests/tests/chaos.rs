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
use drills::Guarantee;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// A request a second, at most two faults held at once.
fn options(seed: u64, seconds: u64, per_minute: f64, kinds: Vec<FaultKind>, plant: bool) -> ChaosOptions {
    ChaosOptions {
        schedule: ScheduleOptions {
            seed,
            duration: Duration::from_secs(seconds),
            per_minute,
            kinds,
            exclude: Vec::new(),
            never_kill: Vec::new(),
            max_in_flight: 2,
        },
        load_rps: 1.0,
        keep_logs: false,
        journal: None,
        cancel: Default::default(),
        plant,
        plant_on_move: false,
        keep: None,
        against: None,
        api_key: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_minute_of_seeded_chaos_breaks_no_invariant() -> TestResult {
    // Seed 4 draws ten of the fifteen kinds in its minute: kills of a coordinator (twice),
    // decode workers and etcd, stops, KV-link delay, reset and corruption, a burst and a
    // slow reader. Its streams resumed through the kills ran past their deadline while
    // loadgen's resuming clients asked for a whole deadline again with each resume;
    // they now ask for what is left of it.
    let o = options(4, 60, 8.0, FaultKind::ALL.to_vec(), false);
    let r = run_chaos(&o).await?;
    eprintln!(
        "chaos seed {}: applied {:?}, {} requests, {} complete, typed {:?}, {} resumed; repeat: {}",
        r.seed, r.applied, r.requests, r.complete, r.typed_errors, r.resumed, r.command
    );
    for a in &r.actions {
        eprintln!("  {:>7} ms {:<5} {:<17} {} {}", a.at_ms, a.what, a.kind.name(), a.target, a.error);
    }
    eprintln!("  KV links: {:?}", r.kv_links);
    assert!(r.violations.is_empty(), "{:#?}", r.violations);
    assert!(r.actions.iter().all(|a| a.error.is_empty()), "every fault applied and lifted: {:#?}", r.actions);
    let kinds: BTreeSet<&str> = r.applied.keys().copied().collect();
    assert!(r.applied.values().sum::<u32>() >= 8 && kinds.len() >= 5, "faults of many kinds: {:?}", r.applied);
    assert_eq!(r.requests, drills::chaos::requests(&o), "the whole load ran, lead-in included");
    let grpc = &r.loads["interactive-grpc"];
    assert!(grpc.requests >= 20 && grpc.complete > 0, "a third of the load over gRPC: {:?}", r.loads);
    eprintln!("  loads: {:?}\n  goodput: {:?}", r.loads, r.goodput);
    // Seed 4's minute leaves about 39% of its faulted time outside every window (nine
    // requests' whole lives there, five needed): judged.
    assert!(r.goodput.ratio.is_some(), "goodput outside fault windows was judged: {:?}", r.goodput);
    assert!(r.complete + r.typed_errors.values().sum::<u32>() as usize == r.requests);
    // The report's other forms: a passing JUnit suite, a timeline with a dot a request,
    // and every process life's memory (etcd, 4 workers, 2 coordinators, and restarts).
    let junit = drills::chaos::junit(&r);
    assert!(junit.contains("tests=\"7\" failures=\"0\""), "{junit}");
    assert_eq!(drills::chaos::svg(&r).matches("<circle").count(), r.requests);
    assert!(r.incarnations.len() >= 7 && r.incarnations.iter().all(|i| i.samples >= 1), "{:?}", r.incarnations);
    Ok(())
}

/// The invariants are not vacuous in a real run: started with the planted bugs (a wrong
/// first token behind HTTP 200, KV blocks never freed, a stream that never ends) and no
/// fault at all — a schedule of every kind, none of it kept (`--keep-faults none`, what a
/// shrink ends on when a failure needs no fault) — the run fails, and names each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn planted_bugs_are_each_caught_and_named() -> TestResult {
    let o = ChaosOptions { keep: Some(Vec::new()), ..options(7, 20, 8.0, FaultKind::ALL.to_vec(), true) };
    let all = drills::chaos::schedule(&o.schedule, &drills::chaos::targets_of(None));
    assert!(all.len() >= 2, "seed 7 draws faults in its 20 s: {all:?}");
    let r = run_chaos(&o).await?;
    for v in &r.violations {
        eprintln!("  {:>7} ms {:?}: {}", v.at_ms, v.guarantee, v.detail);
    }
    assert!(r.schedule.is_empty() && r.actions.is_empty(), "no fault kept, none applied: {:?}", r.actions);
    assert!(!r.passed(), "no fault, and yet a failed run");
    assert!(r.command.ends_with(" --plant --keep-faults none"), "the repeat command plants them too: {}", r.command);
    let found = |g: Guarantee, what: &str| r.violations.iter().any(|v| v.guarantee == g && v.detail.contains(what));
    assert!(found(Guarantee::G1, "answer differs from the no-fault run"), "the swapped token: {:#?}", r.violations);
    assert!(found(Guarantee::G2, "prefill-"), "the leaked blocks, on a prefill worker: {:#?}", r.violations);
    assert!(found(Guarantee::G1, "hung until the client gave up"), "the endless stream: {:#?}", r.violations);
    Ok(())
}
