//! Every drill once on its own small cluster, with no violation; and the
//! vacuity check: a drill whose fault is skipped must fail its proof (G6).
//!
//! Needs the workspace binaries (`cargo build --workspace --bins`), the model
//! (`make model`) and etcd on PATH.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

use drills::{run_drill, DrillOptions, DrillReport, Guarantee};

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

async fn drill(name: &str) -> Result<DrillReport, Box<dyn std::error::Error + Send + Sync>> {
    let t0 = std::time::Instant::now();
    let r = run_drill(name, &DrillOptions::default()).await?;
    eprintln!(
        "{name} ({:.1} s): {} requests, {} complete, errors {:?}, lost {}, p99 TTFT {:?} ms, wall {:.0} ms; proof: {}",
        t0.elapsed().as_secs_f64(),
        r.requests,
        r.complete,
        r.typed_errors,
        r.lost,
        r.p99_ttft_ms,
        r.wall_ms,
        r.proof
    );
    if let Some(g) = &r.goodput {
        eprintln!(
            "{name}: goodput {:.1} tok/s, {:.0}% of the no-overload {:.1}/{:.1} tok/s (before/after) at the machine's \
             speed in each, {:.0}% as measured ({}); {} tokens regenerated to resume; computed {:?}",
            g.tok_s,
            g.ratio * 100.0,
            g.baseline_tok_s[0],
            g.baseline_tok_s[1],
            g.raw_ratio * 100.0,
            g.token_ms_text(),
            g.regenerated_tokens,
            g.computed
        );
    }
    assert!(r.violations.is_empty(), "{name}: {:#?}", r.violations);
    assert!(r.fault_proven, "{name}: {}", r.proof);
    assert_eq!(r.lost, 0, "{name}");
    Ok(r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_kill() -> TestResult {
    let r = drill("decode-kill").await?;
    assert!(r.typed_errors.is_empty() && r.complete == r.requests, "no client sees the kill: {:?}", r.typed_errors);
    Ok(())
}

/// Eight 200-token streams, half sampled, lose their decode worker: every one completes
/// with exactly its undisturbed (seeded) answer (G1 compares each with the engine's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_kill_sampled() -> TestResult {
    let r = drill("decode-kill-sampled").await?;
    assert!(r.typed_errors.is_empty() && r.complete == r.requests, "{:?}", r.typed_errors);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_freeze_migrate() -> TestResult {
    let r = drill("decode-freeze-migrate").await?;
    assert!(r.typed_errors.is_empty() && r.complete == r.requests, "{:?}", r.typed_errors);
    Ok(())
}

/// Without the kill nothing moves: the proof (streams moved off a dead worker) fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_kill_sampled_without_its_fault_fails_its_proof() -> TestResult {
    let r = run_drill("decode-kill-sampled", &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
    assert!(!r.fault_proven, "{}", r.proof);
    let g6 = r.of(Guarantee::G6);
    assert_eq!(g6.len(), 1, "{:#?}", r.violations);
    assert!(g6[0].detail.contains("is still running"), "{:?}", g6[0]);
    assert_eq!(r.violations.len(), 1, "only G6: {:#?}", r.violations);
    assert_eq!(r.complete, r.requests);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_kill_recompute() -> TestResult {
    drill("prefill-kill-recompute").await.map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_kill_before_kv() -> TestResult {
    let r = drill("prefill-kill-before-kv").await?;
    assert_eq!(r.complete, r.requests, "policy recompute: the decode worker prefills itself");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_kill_retry() -> TestResult {
    let r = drill("prefill-kill-retry").await?;
    assert_eq!(r.complete, r.requests, "policy retry: the other prefill worker pushes again");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_kill_fail() -> TestResult {
    let r = drill("prefill-kill-fail").await?;
    assert!(r.typed_errors.keys().all(|k| k.ends_with("kv_load_failed")), "{:?}", r.typed_errors);
    assert!(!r.typed_errors.is_empty(), "policy fail: the cut request ends typed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_corrupt() -> TestResult {
    drill("kv-corrupt").await.map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_restart() -> TestResult {
    let r = drill("etcd-restart").await?;
    assert!(r.g3_skipped_groups.is_empty(), "both groups are counted: {:?}", r.g3_skipped_groups);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect() -> TestResult {
    drill("client-disconnect").await.map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overload_3x() -> TestResult {
    let r = drill("overload-3x").await?;
    assert!(!r.typed_errors.is_empty(), "3x the capacity, yet nothing was refused");
    let g = r.goodput.ok_or("no goodput measured")?;
    assert!(
        g.offered_rps > 2.9 * g.capacity_rps,
        "offered {} req/s against a capacity of {}",
        g.offered_rps,
        g.capacity_rps
    );
    // Both goodput checks ran: at the machine's speed (every load streamed tokens) and
    // the count of requests the decode workers began.
    assert!(g.token_ms.iter().all(Option::is_some), "{:?}", g.token_ms);
    assert!(g.computed.is_some_and(|(begun, completed)| begun > 0.0 && completed > 0), "{:?}", g.computed);
    Ok(())
}

/// Half the clients retry at once, ignoring Retry-After: none of those retries is served
/// before its Retry-After, and goodput holds (the drill's invariants).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_storm() -> TestResult {
    let r = drill("retry-storm").await?;
    let early: u32 = r.load.records.iter().map(|x| x.retries.early).sum();
    let served: u32 = r.load.records.iter().map(|x| x.retries.early_served).sum();
    assert!(early > 0 && served == 0, "{early} early retries, {served} served");
    let g = r.goodput.ok_or("no goodput measured")?;
    assert!(g.offered_rps > 2.9 * g.capacity_rps, "offered {} req/s against {}", g.offered_rps, g.capacity_rps);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_sigstop() -> TestResult {
    drill("worker-sigstop").await.map(drop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_drain() -> TestResult {
    let r = drill("rolling-drain").await?;
    assert_eq!(r.complete, r.requests, "a drain lost a request");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tight_deadlines() -> TestResult {
    let r = drill("tight-deadlines").await?;
    assert!(r.typed_errors.keys().all(|k| k.contains("deadline_exceeded")), "{:?}", r.typed_errors);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_delay() -> TestResult {
    let r = drill("kv-delay").await?;
    assert_eq!(r.complete, r.requests, "latency alone lost a request");
    Ok(())
}

/// Needs root and iptables (`scripts/deps.sh`): the rule goes into the decode worker's namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_loss() -> TestResult {
    let r = drill("kv-loss").await?;
    assert_eq!(r.complete, r.requests, "{}", r.proof);
    Ok(())
}

/// Needs root and tc (`scripts/deps.sh`): the bucket goes into the decode worker's namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_bandwidth() -> TestResult {
    let r = drill("kv-bandwidth").await?;
    assert_eq!(r.complete, r.requests, "{}", r.proof);
    // Without its bucket: no packet held back, transfers faster than the cap; G6 alone fails.
    let r = run_drill("kv-bandwidth", &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
    assert!(!r.fault_proven && r.proof.contains("never held a packet back"), "{}", r.proof);
    assert_eq!(r.of(Guarantee::G6).len(), 1, "{:#?}", r.violations);
    Ok(())
}

/// Needs root and iptables (`scripts/deps.sh`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_blackhole() -> TestResult {
    let r = drill("kv-blackhole").await?;
    assert_eq!(r.complete, r.requests, "{}", r.proof);
    // Each load waits out its 3 s lease, then recomputes: slow, never hung.
    let slowest = r.load.records.iter().map(|x| x.e2e).max().unwrap_or_default();
    assert!(slowest < std::time::Duration::from_secs(20), "a request took {slowest:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_resets() -> TestResult {
    let r = drill("kv-resets").await?;
    assert_eq!(r.complete, r.requests, "{}", r.proof);
    Ok(())
}

/// With its iptables rule never added, kv-blackhole runs clean — and fails on G6 alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blackhole_never_applied_fails_its_proof() -> TestResult {
    let r = run_drill("kv-blackhole", &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
    assert!(!r.fault_proven, "{}", r.proof);
    let g6 = r.of(Guarantee::G6);
    assert_eq!(g6.len(), 1, "{:#?}", r.violations);
    assert!(g6[0].detail.contains("dropped 0 packet(s)"), "{:?}", g6[0]);
    assert!(g6[0].detail.contains("0 load(s) failed"), "{:?}", g6[0]);
    assert_eq!(r.violations.len(), 1, "only G6: {:#?}", r.violations);
    assert_eq!(r.complete, r.requests);
    Ok(())
}

/// With its fault skipped, kv-corrupt runs clean — and must still fail, on G6.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drill_without_its_fault_fails_its_proof() -> TestResult {
    let r = run_drill("kv-corrupt", &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
    assert!(!r.fault_proven, "{}", r.proof);
    let g6 = r.of(Guarantee::G6);
    assert_eq!(g6.len(), 1, "{:#?}", r.violations);
    assert!(g6[0].detail.contains("flipped 0 bytes"), "{:?}", g6[0]);
    assert_eq!(r.violations.len(), 1, "only G6: {:#?}", r.violations);
    assert_eq!(r.complete, r.requests);
    Ok(())
}

#[tokio::test]
async fn an_unknown_drill_is_an_error() {
    assert!(run_drill("no-such-drill", &DrillOptions::default()).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_kill() -> TestResult {
    let r = drill("coordinator-kill").await?;
    // Only the requests in flight on the killed coordinator may fail (a dropped connection).
    assert!(r.typed_errors.is_empty(), "{:?}", r.typed_errors);
    assert_eq!(r.complete + r.coordinator_lost, r.requests);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_relabel() -> TestResult {
    let r = drill("version-relabel").await?;
    assert_eq!(r.complete, r.requests, "a relabel lost a request");
    assert!(r.g3_skipped_groups.is_empty(), "both groups are counted: {:?}", r.g3_skipped_groups);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_grace_short() -> TestResult {
    let r = drill("drain-grace-short").await?;
    assert!(r.typed_errors.is_empty() && r.complete == r.requests, "nothing fails: {:?}", r.typed_errors);
    Ok(())
}

/// With its kill skipped, coordinator-kill fails on G6 alone: coordinator A is still running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_kill_without_its_fault_fails_its_proof() -> TestResult {
    let r = run_drill("coordinator-kill", &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
    assert!(!r.fault_proven, "{}", r.proof);
    let g6 = r.of(Guarantee::G6);
    assert_eq!(g6.len(), 1, "{:#?}", r.violations);
    assert!(g6[0].detail.contains("was never killed: it is still running"), "{:?}", g6[0]);
    assert_eq!(r.violations.len(), 1, "only G6: {:#?}", r.violations);
    assert_eq!((r.complete, r.coordinator_lost), (r.requests, 0));
    Ok(())
}

/// A coordinator SIGKILLed under eight long streams (half sampled): every stream is resumed at
/// the other coordinator and completes with exactly its undisturbed answer (G1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_kill_resume() -> TestResult {
    let r = drill("coordinator-kill-resume").await?;
    assert!(r.typed_errors.is_empty() && r.complete == r.requests, "{:?}", r.typed_errors);
    assert_eq!(r.coordinator_lost, 0, "no stream is lost with its coordinator");
    Ok(())
}

/// Both coordinators drained in turn under load: no client sees a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_rolling_drain() -> TestResult {
    let r = drill("coordinator-rolling-drain").await?;
    assert!(r.typed_errors.is_empty() && r.complete == r.requests, "{:?}", r.typed_errors);
    Ok(())
}

/// Without their faults nothing is resumed: both proofs fail, and nothing else does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_resume_drills_without_their_faults_fail_their_proofs() -> TestResult {
    for (name, why) in [
        ("coordinator-kill-resume", "was never killed: it is still running"),
        ("coordinator-rolling-drain", "drained 0 of 2 coordinators"),
    ] {
        let r = run_drill(name, &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
        assert!(!r.fault_proven, "{name}: {}", r.proof);
        let g6 = r.of(Guarantee::G6);
        assert_eq!(g6.len(), 1, "{name}: {:#?}", r.violations);
        assert!(g6[0].detail.contains(why), "{name}: {:?}", g6[0]);
        assert_eq!(r.violations.len(), 1, "{name}: only G6: {:#?}", r.violations);
        assert_eq!(r.complete, r.requests, "{name}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_errors() -> TestResult {
    let r = drill("prefill-errors").await?;
    assert_eq!(r.complete, r.requests, "policy retry hides the faulty prefill worker");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_unavailable() -> TestResult {
    let r = drill("prefill-unavailable").await?;
    assert!(r.typed_errors.keys().any(|k| k == "http 503 prefill_unavailable"), "{:?}", r.typed_errors);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layout_mismatch() -> TestResult {
    let r = drill("layout-mismatch").await?;
    assert_eq!(r.complete, r.requests, "routing paired the decode worker with another KV layout");
    Ok(())
}

/// With both prefill workers on one layout, layout-mismatch runs clean — and must fail on
/// G6: routing skipped no pair.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layout_mismatch_without_its_fault_fails_its_proof() -> TestResult {
    let r = run_drill("layout-mismatch", &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
    assert!(!r.fault_proven, "{}", r.proof);
    let g6 = r.of(Guarantee::G6);
    assert_eq!(g6.len(), 1, "{:#?}", r.violations);
    assert!(g6[0].detail.contains("did not leave the mismatched prefill worker out"), "{:?}", g6[0]);
    assert_eq!(r.violations.len(), 1, "only G6: {:#?}", r.violations);
    assert_eq!(r.complete, r.requests);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_reader() -> TestResult {
    let r = drill("slow-reader").await?;
    assert_eq!(r.complete, r.requests, "a slow reader held up the normal load");
    Ok(())
}

/// With a healthy prefill worker, prefill-unavailable runs clean — and must fail on G6,
/// saying no breaker opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_unavailable_without_its_fault_fails_its_proof() -> TestResult {
    let r = run_drill("prefill-unavailable", &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
    assert!(!r.fault_proven, "{}", r.proof);
    let g6 = r.of(Guarantee::G6);
    assert_eq!(g6.len(), 1, "{:#?}", r.violations);
    assert!(g6[0].detail.contains("no fast 503 behind an open breaker: breaker opened 0 time(s)"), "{:?}", g6[0]);
    assert_eq!(r.violations.len(), 1, "only G6: {:#?}", r.violations);
    assert_eq!(r.complete, r.requests);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_leader_kill() -> TestResult {
    let r = drill("etcd-leader-kill").await?;
    assert_eq!(r.complete, r.requests, "a follower took over, yet a request failed");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_quorum_loss() -> TestResult {
    let r = drill("etcd-quorum-loss").await?;
    assert!(r.complete >= 2, "requests before the outage complete: {} of {}", r.complete, r.requests);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_etcd_cutoff() -> TestResult {
    let r = drill("worker-etcd-cutoff").await?;
    assert_eq!(r.complete, r.requests, "the other decode worker should have carried the load");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordinator_etcd_cutoff() -> TestResult {
    let r = drill("coordinator-etcd-cutoff").await?;
    assert!(r.typed_errors.keys().all(|k| k.contains("registry_unavailable")), "{:?}", r.typed_errors);
    Ok(())
}

/// With its partition skipped, worker-etcd-cutoff runs clean — and must still fail, on G6,
/// saying the proxy dropped nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_cutoff_without_its_partition_fails_its_proof() -> TestResult {
    let r = run_drill("worker-etcd-cutoff", &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
    assert!(!r.fault_proven, "{}", r.proof);
    let g6 = r.of(Guarantee::G6);
    assert_eq!(g6.len(), 1, "{:#?}", r.violations);
    assert!(g6[0].detail.contains("decode-1's etcd link dropped 0 bytes"), "{:?}", g6[0]);
    assert_eq!(r.violations.len(), 1, "only G6: {:#?}", r.violations);
    assert_eq!(r.complete, r.requests);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_reorder() -> TestResult {
    let r = drill("kv-reorder").await?;
    assert_eq!(r.complete, r.requests, "policy recompute answers every request");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_link_resets() -> TestResult {
    let r = drill("request-link-resets").await?;
    // The cut requests end in transport errors, counted apart; the rest complete.
    assert!(r.typed_errors.is_empty(), "{:?}", r.typed_errors);
    assert!(r.cut_by_fault >= 1, "{}", r.proof);
    assert_eq!(r.complete + r.cut_by_fault, r.requests);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_link_delay() -> TestResult {
    let r = drill("request-link-delay").await?;
    assert_eq!(r.complete, r.requests);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn control_link_resets() -> TestResult {
    let r = drill("control-link-resets").await?;
    // Mid-answer cuts end typed; the rest (re-routed before their first token, or untouched) complete.
    assert!(r.typed_errors.keys().all(|k| k == "stream_error worker_stream"), "{:?}", r.typed_errors);
    Ok(())
}

/// With its resets skipped, request-link-resets runs clean — and must still fail, on G6,
/// saying the proxy reset nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_link_resets_without_its_resets_fails_its_proof() -> TestResult {
    let r = run_drill("request-link-resets", &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
    assert!(!r.fault_proven, "{}", r.proof);
    let g6 = r.of(Guarantee::G6);
    assert_eq!(g6.len(), 1, "{:#?}", r.violations);
    assert!(g6[0].detail.contains("the proxy reset 0 client connection(s)"), "{:?}", g6[0]);
    assert_eq!(r.violations.len(), 1, "only G6: {:#?}", r.violations);
    assert_eq!((r.complete, r.cut_by_fault), (r.requests, 0));
    Ok(())
}

/// The KV-link drills that apply to one-sided transfer, with KV over ucx (the decode
/// workers' `--kv-transport ucx`; the prefill workers put into their landing region).
/// prefill-kill under each policy: the push held by stopping its sender once the decode
/// worker granted it a landing range, then SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_kill_over_ucx_under_each_policy() -> TestResult {
    let r = drill("prefill-kill-recompute-ucx").await?;
    assert_eq!(r.complete, r.requests, "policy recompute: the decode worker prefills itself");
    let r = drill("prefill-kill-retry-ucx").await?;
    assert_eq!(r.complete, r.requests, "policy retry: the other prefill worker pushes again");
    let r = drill("prefill-kill-fail-ucx").await?;
    assert!(r.typed_errors.keys().all(|k| k.ends_with("kv_load_failed")), "{:?}", r.typed_errors);
    assert!(!r.typed_errors.is_empty(), "policy fail: the cut request ends typed");
    Ok(())
}

/// kv-corrupt over ucx (the byte flipped by the sender after its checksum), and
/// version-relabel with the relabelled decode worker's KV over ucx.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_corrupt_and_version_relabel_over_ucx() -> TestResult {
    let r = drill("kv-corrupt-ucx").await?;
    assert!(r.proof.contains("refused by checksum"), "{}", r.proof);
    let r = drill("version-relabel-ucx").await?;
    assert_eq!(r.complete, r.requests, "a relabel lost a request");
    Ok(())
}

/// The ucx drills' proofs fail when their fault is skipped: no flag, no flipped byte; a
/// stopped sender continued instead of killed; no rule, no dropped packet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ucx_drills_without_their_fault_fail_their_proof() -> TestResult {
    for name in ["kv-corrupt-ucx", "prefill-kill-recompute-ucx", "kv-blackhole-ucx"] {
        let r = run_drill(name, &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
        assert!(!r.fault_proven, "{name}: {}", r.proof);
        assert_eq!(r.of(Guarantee::G6).len(), 1, "{name}: {:#?}", r.violations);
        assert_eq!(r.violations.len(), 1, "{name}: only G6: {:#?}", r.violations);
        assert_eq!(r.complete, r.requests, "{name}");
    }
    Ok(())
}

/// kv-blackhole with KV over ucx: UCX over TCP on decode-0's veth, every UCX packet into its
/// namespace dropped for part of the load. Needs root and iptables (`scripts/deps.sh`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_blackhole_over_ucx() -> TestResult {
    let r = drill("kv-blackhole-ucx").await?;
    assert_eq!(r.complete, r.requests, "{}", r.proof);
    assert!(r.proof.contains("UCX over TCP"), "{}", r.proof);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noisy_neighbour() -> TestResult {
    let r = drill("noisy-neighbour").await?;
    assert_eq!(r.complete, r.requests, "B's requests all complete");
    Ok(())
}

/// Without A's flood the run is clean, and the proof fails: A was never refused and
/// admitted nothing near its quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn noisy_neighbour_without_its_flood_fails_its_proof() -> TestResult {
    let r = run_drill("noisy-neighbour", &DrillOptions { skip_fault: true, ..DrillOptions::default() }).await?;
    assert!(!r.fault_proven, "{}", r.proof);
    assert!(r.proof.contains("A's flood did not run"), "{}", r.proof);
    assert_eq!(r.violations.len(), 1, "only G6: {:#?}", r.violations);
    Ok(())
}
