//! The ucx transport's fence, with real worker processes on one host, where
//! the prefill worker stores KV straight into the decode worker's pool
//! blocks (the direct path, `--ucx-direct`, on by default): a prefill worker
//! stopped (SIGSTOP) in the middle of its stores outlives its reservation's
//! lease while the decode worker serves other requests on the same pool,
//! then resumes (SIGCONT).
//!
//! What must hold: the other requests' outputs are the engine's bit for bit;
//! the stopped sender's transfer is refused (its load counted failed as
//! `lease_expired`, none of its bytes accepted after the lease); its pool
//! blocks stay quarantined — out of the pool — for as long as it is
//! stopped, and come back only by its fence once it runs again. Every step
//! waits on metrics, never on time. (The landing region's own fence, for
//! senders on other hosts, is tested in `kvtransfer/tests/ucx.rs` and
//! across namespaces in `cluster-tests/tests/ucx_netns.rs`.)
//!
//! And the other KV-load failures over ucx: a prefill worker killed (kill -9)
//! mid-transfer under each `kv_load_failure_policy`, its blocks released
//! once UCX reports the dead endpoint and its process is gone; a byte
//! flipped after its checksum was taken (the prefill worker's
//! `--fault-kv-corrupt` drill hook) refused by checksum under each policy;
//! another version group refused before any grant or byte.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;
#[path = "common/rpc.rs"]
mod rpc;

use common::{decode_worker, prefill_worker, prompt_of, reference, scrape, wait_metric, Signal, TestResult};
use facts::metrics::decode::{
    CONNECTIONS_ACCEPTED, CONNECTIONS_CLOSED, FRAMES_REFUSED, KV_LOAD_FAILURES, KV_RECEIVED_BYTES,
    KV_TRANSFERS_COMPLETED, POLICY_OUTCOMES, RESERVATIONS_EXPIRED, UCX_DIRECT_GRANTS, UCX_FENCES, UCX_LANDING_IN_USE,
    UCX_LANDING_REFUSED, UCX_QUARANTINED_BLOCKS, UCX_QUARANTINED_RANGES,
};
use facts::metrics::prefill::{FAULTS_INJECTED, KV_LAYERS_SENT, KV_TRANSFER_BYTES};
use proto::worker::v1::{ErrorKind, KvLoadFailurePolicy};
use rpc::{
    assert_kv_used, assert_no_kv_left, client, generate, kind, request, target, with_policy, Outcome, GROUP, MAX_TOKENS,
};

/// K+V bytes of one block of the model's KV (30 layers x K,V x 3 heads x 64 x f16 x 16).
const BLOCK_BYTES: usize = 368_640;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_sender_past_its_lease_never_writes_into_reused_kv() -> TestResult {
    let tok = common::tokenizer()?;
    // The stalled transfer: 65 blocks, so its prefill runs for seconds after the
    // first put, which is when the sender is stopped.
    let stalled_prompt = prompt_of(&tok, 1030)?;
    // They need 19, 20 and 3 blocks: the pool (100) holds each beside the stalled
    // reservation's 65, which are never theirs.
    let others = vec![prompt_of(&tok, 300)?, prompt_of(&tok, 310)?, prompt_of(&tok, 37)?];
    let want = reference(&others, MAX_TOKENS)?;

    let stalled = prefill_worker(GROUP, &["--transfer-timeout-ms", "120000"])?;
    let healthy = prefill_worker(GROUP, &[])?;
    // The lease is what the stopped sender outlives; the healthy worker's prompts
    // (at most 310 tokens) prefill well within it.
    let decode = decode_worker(
        GROUP,
        &[
            "--kv-transport",
            "ucx",
            "--kv-load-failure-policy",
            "fail",
            "--reservation-ttl-ms",
            "15000",
            "--kv-blocks",
            "100",
        ],
    )?;
    let metrics = decode.addr("metrics")?;
    let c = client(&decode).await?;

    // 1. The stalled request: stopped once the decode worker granted it its pool blocks
    //    (its push claims them as its prefill starts: around its first store, and
    //    long before its last).
    let req = with_policy(request("stalled", &stalled_prompt, vec![target(&stalled)?]), KvLoadFailurePolicy::Fail);
    let mut c1 = c.clone();
    let call = tokio::spawn(async move { generate(&mut c1, req).await });
    wait_metric(&metrics, UCX_DIRECT_GRANTS, &[], |v| v == 1.0).await?;
    stalled.signal(Signal::Stop)?;

    // 2. Its lease runs out: the load fails as lease_expired, its reservation ends, and its
    //    65 pool blocks stay out of the pool: the stopped sender may still store into them.
    let got = call.await??;
    assert_eq!(kind(&got), Some(ErrorKind::KvLoadFailed), "the stalled request: {got:?}");
    assert!(got.tokens.is_empty(), "tokens from a transfer that never completed: {got:?}");
    wait_metric(&metrics, KV_LOAD_FAILURES, &[("reason", "lease_expired")], |v| v == 1.0).await?;
    wait_metric(&metrics, UCX_QUARANTINED_BLOCKS, &[], |v| v == 65.0).await?;
    assert_kv_used("after the lease", &decode, 65).await?;
    let page = scrape(&metrics).await?;
    assert_eq!(page.get(RESERVATIONS_EXPIRED, &[])?, 1.0);
    assert_eq!(page.get(UCX_FENCES, &[])?, 0.0, "a fence completed while its sender was stopped");
    assert_eq!(page.get(UCX_LANDING_IN_USE, &[])?, 0.0, "the stalled transfer went through the landing region");
    // What the stalled sender delivered before it stopped, and all it will ever deliver.
    let stalled_bytes = page.get(KV_RECEIVED_BYTES, &[])?;
    let stalled_all = (65 * BLOCK_BYTES) as f64;
    assert!(stalled_bytes < stalled_all, "the stalled transfer was not mid-way: {stalled_bytes} bytes in");

    // 3. Other requests on the same pool while the sender is stopped: the engine's tokens,
    //    written directly too, and the quarantined blocks never handed out or freed.
    let mut blocks = 0;
    for (i, p) in others.iter().enumerate() {
        let mut ci = c.clone();
        let got = generate(&mut ci, request(&format!("other-{i}"), p, vec![target(&healthy)?])).await?;
        assert!(got.end.as_ref().is_ok_and(|f| f.prefilled_remotely), "other {i}: {got:?}");
        assert_eq!(got.tokens, want[i], "other {i} ({} tokens) differs from the engine", p.len());
        blocks += p.len().div_ceil(16);
        let page = scrape(&metrics).await?;
        assert_eq!(page.get(UCX_QUARANTINED_BLOCKS, &[])?, 65.0, "after other {i}");
        assert_eq!(page.get(UCX_FENCES, &[])?, 0.0, "after other {i}: fenced while stopped");
        assert_kv_used(&format!("after other {i}"), &decode, 65).await?;
    }
    let others_bytes = (blocks * BLOCK_BYTES) as f64;
    let page = scrape(&metrics).await?;
    assert_eq!(page.get(KV_RECEIVED_BYTES, &[])?, stalled_bytes + others_bytes);
    assert_eq!(page.get(KV_TRANSFERS_COMPLETED, &[])?, others.len() as f64);
    assert_eq!(page.get(UCX_DIRECT_GRANTS, &[])?, 1.0 + others.len() as f64, "every transfer went to the pool");

    // 4. The sender runs again: whatever it still stores lands in its quarantined blocks;
    //    it learns of the Abort and fences, and only then do its blocks go back.
    stalled.signal(Signal::Cont)?;
    wait_metric(&metrics, UCX_FENCES, &[], |v| v == 1.0).await?;
    wait_metric(&metrics, UCX_QUARANTINED_BLOCKS, &[], |v| v == 0.0).await?;
    assert_no_kv_left("after the fence", &decode).await?;
    let page = scrape(&metrics).await?;
    assert_eq!(page.get(KV_RECEIVED_BYTES, &[])?, stalled_bytes + others_bytes, "late bytes were accepted");
    assert_eq!(page.get(KV_TRANSFERS_COMPLETED, &[])?, others.len() as f64, "the late transfer completed");
    let sp = scrape(&stalled.addr("metrics")?).await?;
    assert_eq!(sp.get(KV_TRANSFER_BYTES, &[])?, 0.0, "the stalled sender counted a completed transfer");

    // 5. The released range serves again, and the answers are still the engine's.
    let mut ci = c.clone();
    let got = generate(&mut ci, request("after-fence", &others[0], vec![target(&healthy)?])).await?;
    assert_eq!(got.tokens, want[0], "after the fence: {got:?}");
    assert!(got.end.as_ref().is_ok_and(|f| f.prefilled_remotely), "after the fence: {got:?}");
    // The healthy worker's engine stored its layers in place (no gather): the
    // writer is granted as each prefill starts, so at most a prompt's first layers
    // can be gathered.
    let hp = scrape(&healthy.addr("metrics")?).await?;
    let in_place = hp.get(KV_LAYERS_SENT, &[("path", "in_place")])?;
    let gathered = hp.get(KV_LAYERS_SENT, &[("path", "gathered")])?;
    assert!(in_place > gathered, "layers stored in place {in_place}, gathered {gathered}");
    assert_no_kv_left("at the end", &decode).await
}

/// What `policy` made of a request whose first prefill attempt failed: under retry a second
/// attempt on `alive` and the engine's tokens (`want`) from its KV; under recompute no other
/// attempt and the engine's tokens prefilled here; under fail a typed `KvLoadFailed` and no
/// token.
fn assert_policy_outcome(policy: KvLoadFailurePolicy, got: &Outcome, alive: &str, want: &[u32]) {
    let rest: Vec<_> = got.attempts.iter().skip(1).map(|(w, how)| (w.as_str(), how.as_str())).collect();
    match policy {
        KvLoadFailurePolicy::Retry => {
            assert_eq!(rest, [(alive, "ok")], "retry: {:?}", got.attempts);
            assert_eq!(got.tokens, want, "retry: {got:?}");
            assert!(got.end.as_ref().is_ok_and(|f| f.prefilled_remotely), "retry: {got:?}");
        }
        KvLoadFailurePolicy::Recompute => {
            assert!(rest.is_empty(), "recompute: {:?}", got.attempts);
            assert_eq!(got.tokens, want, "recompute: {got:?}");
            assert!(got.end.as_ref().is_ok_and(|f| !f.prefilled_remotely), "recompute: {got:?}");
        }
        _ => {
            assert!(rest.is_empty(), "fail: {:?}", got.attempts);
            assert_eq!(kind(got), Some(ErrorKind::KvLoadFailed), "fail: {got:?}");
            assert!(got.tokens.is_empty(), "fail: tokens before the error: {got:?}");
        }
    }
}

/// A decode worker receiving KV over ucx, policy fail unless a request overrides it, every
/// prompt prefilled remotely; leases long enough (120 s) for a failed attempt and a whole
/// retry on a loaded 2-core machine (these tests judge outcomes, not timing).
fn ucx_decode_worker() -> opskit::Result<common::Worker> {
    decode_worker(
        GROUP,
        &["--kv-transport", "ucx", "--kv-load-failure-policy", "fail", "--reservation-ttl-ms", "120000"],
    )
}

/// Long enough that the kill lands while its KV is still being put (about 40 blocks).
const KILL_PROMPT: usize = 600;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_killed_mid_transfer_under_each_policy() -> TestResult {
    let tok = common::tokenizer()?;
    let prompt = prompt_of(&tok, KILL_PROMPT)?;
    let want = reference(std::slice::from_ref(&prompt), MAX_TOKENS)?.remove(0);
    let backup = prefill_worker(GROUP, &["--transfer-timeout-ms", "120000"])?;
    let decode = ucx_decode_worker()?;
    let metrics = decode.addr("metrics")?;
    let c = client(&decode).await?;

    let policies = [KvLoadFailurePolicy::Recompute, KvLoadFailurePolicy::Retry, KvLoadFailurePolicy::Fail];
    for (round, policy) in policies.into_iter().enumerate() {
        let mut doomed = prefill_worker(GROUP, &[])?;
        let req = with_policy(
            request(&format!("kill-{policy:?}"), &prompt, vec![target(&doomed)?, target(&backup)?]),
            policy,
        );
        let mut c2 = c.clone();
        let call = tokio::spawn(async move { generate(&mut c2, req).await });
        // Mid-transfer: the doomed worker was granted its pool blocks (first store under way).
        let grants = match round {
            0 => 1.0,
            // Each earlier round: the doomed transfer, and under retry the backup's.
            r => 1.0 + r as f64 + f64::from(r > 1),
        };
        wait_metric(&metrics, UCX_DIRECT_GRANTS, &[], |v| v == grants).await?;
        doomed.kill9().await?;
        let got = call.await??;
        let (dead, alive) = (format!("pid-{}", doomed.pid), format!("pid-{}", backup.pid));
        let failed = got.attempts.first().filter(|(w, how)| *w == dead && how != "ok");
        assert!(failed.is_some(), "{policy:?}: the doomed worker's failure is reported: {:?}", got.attempts);
        assert_policy_outcome(policy, &got, &alive, &want);
        // The dead sender's blocks are held (granted, or quarantined once the reservation
        // ended) until UCX reports its endpoint failed and its process is gone; then the
        // connection closes as peer_failed and every block is back in the pool.
        let dead_links = (round + 1) as f64;
        wait_metric(&metrics, CONNECTIONS_CLOSED, &[("reason", "peer_failed")], |v| v == dead_links).await?;
        wait_metric(&metrics, UCX_QUARANTINED_BLOCKS, &[], |v| v == 0.0).await?;
        assert_eq!(scrape(&metrics).await?.get(UCX_LANDING_IN_USE, &[])?, 0.0, "{policy:?}: landed, not direct");
        assert_no_kv_left(&format!("{policy:?}"), &decode).await?;
    }
    for (p, o) in [("recompute", "recomputed"), ("retry", "retried"), ("fail", "failed")] {
        wait_metric(&metrics, POLICY_OUTCOMES, &[("policy", p), ("outcome", o)], |v| v == 1.0).await?;
    }
    wait_metric(&metrics, KV_LOAD_FAILURES, &[("reason", "rpc")], |v| v == 3.0).await?;
    // Only the retried transfer completed: the killed ones' bytes never counted as a transfer.
    assert_eq!(scrape(&metrics).await?.get(KV_TRANSFERS_COMPLETED, &[])?, 1.0);
    Ok(())
}

/// A byte of a transfer's first store flipped in the decode worker's pool after the
/// checksum was taken (`--fault-kv-corrupt`, one transfer per policy): the decode worker's
/// CRC over its own pool blocks refuses it, the load fails as `corrupt`, and each policy
/// does its part with the engine's tokens where there are tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_flipped_after_the_checksum_is_refused_under_each_policy() -> TestResult {
    let tok = common::tokenizer()?;
    let prompt = prompt_of(&tok, 64)?;
    let want = reference(std::slice::from_ref(&prompt), MAX_TOKENS)?.remove(0);
    let policies = [KvLoadFailurePolicy::Recompute, KvLoadFailurePolicy::Retry, KvLoadFailurePolicy::Fail];
    let n = policies.len().to_string();
    let version =
        std::process::Command::new(opskit::process::bin("tandem-prefill-worker")?).arg("--version").output()?;
    assert!(
        String::from_utf8_lossy(&version.stdout).contains("fault-injection"),
        "the prefill worker was built without its fault hooks: build with `--features prefill-worker/fault-injection` \
         (make test does)"
    );
    let corrupter = prefill_worker(GROUP, &["--fault-kv-corrupt", &n, "--transfer-timeout-ms", "120000"])?;
    let healthy = prefill_worker(GROUP, &["--transfer-timeout-ms", "120000"])?;
    let decode = ucx_decode_worker()?;
    let metrics = decode.addr("metrics")?;
    let corrupter_metrics = corrupter.addr("metrics")?;
    let c = client(&decode).await?;
    let (bad, good) = (format!("pid-{}", corrupter.pid), format!("pid-{}", healthy.pid));
    let flipped = [("fault", "kv_corrupt")];
    assert_eq!(scrape(&corrupter_metrics).await?.get(FAULTS_INJECTED, &flipped)?, 0.0, "flipped before any transfer");

    for (round, policy) in policies.into_iter().enumerate() {
        let req = with_policy(
            request(&format!("corrupt-{policy:?}"), &prompt, vec![target(&corrupter)?, target(&healthy)?]),
            policy,
        );
        let mut ci = c.clone();
        let got = generate(&mut ci, req).await?;
        let first = got.attempts.first().map(|(w, how)| (w.as_str(), how.as_str()));
        assert_eq!(first, Some((bad.as_str(), "corrupt")), "{policy:?}: the corrupted attempt: {:?}", got.attempts);
        assert_policy_outcome(policy, &got, &good, &want);
        // The fault took effect exactly once per round, and the receiver, not the link,
        // refused it: by checksum, over its own pool blocks.
        let rounds = (round + 1) as f64;
        assert_eq!(scrape(&corrupter_metrics).await?.get(FAULTS_INJECTED, &flipped)?, rounds, "{policy:?}");
        let page = scrape(&metrics).await?;
        assert_eq!(page.get(FRAMES_REFUSED, &[("reason", "checksum")])?, rounds, "{policy:?}");
        assert_eq!(page.get(KV_LOAD_FAILURES, &[("reason", "corrupt")])?, rounds, "{policy:?}");
        assert_eq!(page.sum(KV_LOAD_FAILURES, &[])?, rounds, "{policy:?}: a failure other than the checksum");
        // The refused blocks are quarantined until the corrupter learns of the Abort and
        // fences; then every block is back in the pool.
        wait_metric(&metrics, UCX_FENCES, &[], |v| v == rounds).await?;
        wait_metric(&metrics, UCX_QUARANTINED_BLOCKS, &[], |v| v == 0.0).await?;
        let page = scrape(&metrics).await?;
        assert_eq!(page.get(UCX_LANDING_IN_USE, &[])?, 0.0, "{policy:?}");
        assert_eq!(page.get(UCX_QUARANTINED_RANGES, &[])?, 0.0, "{policy:?}");
        assert_eq!(page.get(UCX_DIRECT_GRANTS, &[])?, rounds + f64::from(round > 0), "{policy:?}: not to the pool");
        assert_no_kv_left(&format!("{policy:?}"), &decode).await?;
    }
    for (p, o) in [("recompute", "recomputed"), ("retry", "retried"), ("fail", "failed")] {
        wait_metric(&metrics, POLICY_OUTCOMES, &[("policy", p), ("outcome", o)], |v| v == 1.0).await?;
    }
    // Only the retry's transfer from the healthy worker completed; the corrupter completed none.
    let page = scrape(&metrics).await?;
    assert_eq!(page.get(KV_TRANSFERS_COMPLETED, &[])?, 1.0);
    assert_eq!(page.get(KV_RECEIVED_BYTES, &[])?, (prompt.len().div_ceil(16) * BLOCK_BYTES) as f64);
    assert_eq!(scrape(&corrupter_metrics).await?.get(KV_TRANSFER_BYTES, &[])?, 0.0, "the corrupter completed one");
    Ok(())
}

/// A prefill worker of another version group is refused before it connects: no UCX
/// connection, no landing range, no byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_version_group_moves_zero_bytes() -> TestResult {
    let tok = common::tokenizer()?;
    let prompt = prompt_of(&tok, 64)?;
    let other_group = prefill_worker("g2", &[])?;
    let decode = decode_worker(GROUP, &["--kv-transport", "ucx", "--kv-load-failure-policy", "fail"])?;
    let mut c = client(&decode).await?;
    let got = generate(&mut c, request("other-group", &prompt, vec![target(&other_group)?])).await?;
    assert_eq!(kind(&got), Some(ErrorKind::VersionMismatch), "{got:?}");
    assert!(got.tokens.is_empty(), "{got:?}");
    let metrics = decode.addr("metrics")?;
    wait_metric(&metrics, KV_LOAD_FAILURES, &[("reason", "version_mismatch")], |v| v == 1.0).await?;
    let page = scrape(&metrics).await?;
    assert_eq!(page.get(KV_RECEIVED_BYTES, &[])?, 0.0, "KV crossed groups");
    assert_eq!(page.get(CONNECTIONS_ACCEPTED, &[])?, 0.0, "a UCX connection from another group");
    assert_eq!(page.get(UCX_LANDING_IN_USE, &[])?, 0.0);
    assert_eq!(page.sum(UCX_LANDING_REFUSED, &[])?, 0.0, "a landing claim from another group");
    let op = scrape(&other_group.addr("metrics")?).await?;
    assert_eq!(op.get(KV_TRANSFER_BYTES, &[])?, 0.0);
    assert_no_kv_left("after the refusal", &decode).await
}
