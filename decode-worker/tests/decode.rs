//! Real `tandem-decode-worker` and `tandem-prefill-worker` processes on
//! loopback: remote prefill gives the single-process engine's greedy output
//! token for token with the KV provably crossing the wire, and every way a
//! KV load can fail (prefill worker killed mid-transfer, a corrupt frame, a
//! version mismatch, an expired lease, a deadline) ends in the one outcome
//! the policy names, with no KV left behind on either worker.
//!
//! Faults on the KV link come from a userspace proxy (tests/common) that
//! the decode worker advertises as its transfer address.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;
#[path = "common/rpc.rs"]
mod rpc;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::{
    decode_worker, prefill_worker, prompt_of, reference, scrape, wait_metric, within, Fault, Proxy, Signal, TestResult,
    Worker, WAIT,
};
use facts::metrics::decode::{
    CONNECTIONS_ACCEPTED, CONNECTIONS_CLOSED, DECODE_REQUESTS, FRAMES_REFUSED, KV_LAYERS_READ_IN_PLACE,
    KV_LOAD_FAILURES, KV_RECEIVED_BYTES, KV_TRANSFERS_COMPLETED, POLICY_INFO, POLICY_OUTCOMES, PREFILL_ROUTE,
    RESERVATIONS_EXPIRED, TRANSPORT_INFO, TTFT, UCX_LANDING_IN_USE, UCX_QUARANTINED_RANGES,
};
use facts::metrics::prefill::KV_TRANSFER_BYTES;
use proto::worker::v1::{ErrorKind, HealthRequest, KvLoadFailurePolicy};
use rpc::{
    assert_no_kv_left, client, generate, hold_prefill_worker, kind, request, target, with_policy, GROUP, MAX_TOKENS,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_matches_the_single_process_engine() -> TestResult {
    let tok = common::tokenizer()?;
    let prompts = vec![prompt_of(&tok, 1)?, prompt_of(&tok, 37)?, prompt_of(&tok, 1030)?];
    let want = reference(&prompts, MAX_TOKENS)?;
    // Bit-exactness, not timing: a 1030-token prefill on one thread of a loaded 2-core
    // machine has outlived the default 30 s reservation lease (CI beside drills).
    let prefill = prefill_worker(GROUP, &["--transfer-timeout-ms", "120000"])?;
    let decode = decode_worker(GROUP, &["--kv-load-failure-policy", "fail", "--reservation-ttl-ms", "120000"])?;
    let mut c = client(&decode).await?;

    let mut remote_blocks = 0;
    for (i, p) in prompts.iter().enumerate() {
        let got = generate(&mut c, request(&format!("r{i}"), p, vec![target(&prefill)?])).await?;
        let fin = got.end.as_ref().map_err(|e| format!("prompt of {} tokens failed: {e:?}", p.len()))?;
        assert!(fin.prefilled_remotely, "prompt {i} was not prefilled remotely: {fin:?}");
        assert_eq!(got.tokens, want[i], "prompt of {} tokens: remote output differs from the engine's", p.len());
        assert_eq!((fin.prompt_tokens as usize, fin.generated_tokens), (p.len(), MAX_TOKENS));
        remote_blocks += p.len().div_ceil(16);
    }
    // A repeat takes its full blocks from the prefill worker's prefix cache,
    // and the answer says how many prompt tokens that was.
    let again = generate(&mut c, request("r1-again", &prompts[1], vec![target(&prefill)?])).await?;
    let fin = again.end.as_ref().map_err(|e| format!("the repeat failed: {e:?}"))?;
    assert_eq!(again.tokens, want[1], "the cached prefill's output differs from the engine's");
    assert_eq!((fin.prefilled_remotely, fin.cached_prompt_tokens as usize), (true, (prompts[1].len() - 1) / 16 * 16));
    remote_blocks += prompts[1].len().div_ceil(16);
    // The same prompt without a prefill worker takes the local route.
    let local = generate(&mut c, request("local", &prompts[1], vec![])).await?;
    assert_eq!(local.tokens, want[1]);
    assert!(local.end.as_ref().is_ok_and(|f| !f.prefilled_remotely), "{local:?}");

    // The KV crossed the wire: every layer of every reserved block, once.
    let per_block = 30 * 2 * 3 * 64 * 2 * 16; // layers x (K, V) x heads x dim x f16 x block
    let metrics = decode.addr("metrics")?;
    let page = scrape(&metrics).await?;
    assert_eq!(page.get(KV_RECEIVED_BYTES, &[])?, (remote_blocks * per_block) as f64);
    assert_eq!(page.get(KV_TRANSFERS_COMPLETED, &[])?, (prompts.len() + 1) as f64);
    // Read straight into the pool (tcp_direct, the default): every layer of
    // the four transfers in one frame or more.
    wait_metric(&metrics, KV_LAYERS_READ_IN_PLACE, &[], |v| v >= 4.0 * 30.0).await?;
    assert_eq!(page.get(PREFILL_ROUTE, &[("route", "remote")])?, 4.0);
    assert_eq!(page.get(PREFILL_ROUTE, &[("route", "local")])?, 1.0);
    assert_eq!(page.get(DECODE_REQUESTS, &[("outcome", "ok")])?, 5.0);
    assert_eq!(page.get(&format!("{TTFT}_count"), &[])?, 5.0);
    assert_eq!(page.get(POLICY_INFO, &[("policy", "fail")])?, 1.0);
    let ppage = scrape(&prefill.addr("metrics")?).await?;
    assert_eq!(ppage.get(KV_TRANSFER_BYTES, &[])?, (remote_blocks * per_block) as f64);
    assert_no_kv_left("after remote prefill", &decode).await
}

/// A continuation (request migration): given the prompt and the first k tokens of an
/// answer, a decode worker generates the rest exactly, prefilled remotely or locally, and
/// numbers its tokens from k; a continuation made for another determinism fingerprint is
/// refused with a typed error before any work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuation_goes_on_exactly_and_another_determinism_is_refused() -> TestResult {
    let tok = common::tokenizer()?;
    let prompt = prompt_of(&tok, 40)?;
    let want = reference(std::slice::from_ref(&prompt), MAX_TOKENS)?.remove(0);
    let prefill = prefill_worker(GROUP, &[])?;
    let decode = decode_worker(GROUP, &["--kv-load-failure-policy", "fail"])?;
    let mut c = client(&decode).await?;
    let own = c.health(HealthRequest::default()).await?.into_inner().determinism_fingerprint;
    assert_eq!(own.len(), 32, "Health reports the determinism fingerprint");
    let continued = |id: &str, k: usize, prefill: Vec<proto::worker::v1::PrefillTarget>, fp: Vec<u8>| {
        let mut r = request(id, &prompt, prefill);
        r.generated_ids = want[..k].to_vec();
        if let Some(s) = r.sampling.as_mut() {
            s.max_tokens = MAX_TOKENS - k as u32;
        }
        r.determinism_fingerprint = fp;
        r
    };
    let all = MAX_TOKENS as usize;
    for (k, remote) in [(1, true), (5, true), (5, false), (all - 1, true)] {
        let targets = if remote { vec![target(&prefill)?] } else { Vec::new() };
        let got = generate(&mut c, continued(&format!("k{k}-{remote}"), k, targets, own.clone())).await?;
        let fin = got.end.as_ref().map_err(|e| format!("continuation from {k} failed: {e:?}"))?;
        assert_eq!(got.tokens, want[k..], "continued from token {k} ({})", if remote { "remote" } else { "local" });
        let indices: Vec<Option<u32>> = (k..all).map(|i| Some(i as u32)).collect();
        assert_eq!(got.indices, indices, "tokens are numbered after the ones it resumed from");
        assert_eq!((fin.prefilled_remotely, fin.prompt_tokens as usize), (remote, prompt.len()));
    }
    let mut other = own.clone();
    other[0] ^= 1;
    for remote in [true, false] {
        let targets = if remote { vec![target(&prefill)?] } else { Vec::new() };
        let refused = generate(&mut c, continued(&format!("other-{remote}"), 3, targets, other.clone())).await?;
        assert_eq!(kind(&refused), Some(ErrorKind::VersionMismatch), "{refused:?}");
        assert!(refused.tokens.is_empty(), "nothing was generated for it");
        let message = refused.end.err().map(|e| e.message).unwrap_or_default();
        assert!(message.contains("continuation refused") && message.contains("determinism"), "{message}");
    }
    assert_no_kv_left("after continuations", &decode).await
}

/// Remote prefill over `transport` of prompts `lengths` tokens long gives the engine's
/// output and moves every block, counted as blocks x block bytes on both sides.
async fn remote_prefill_over(transport: &str, lengths: &[usize]) -> TestResult {
    let tok = common::tokenizer()?;
    let prompts = lengths.iter().map(|&n| prompt_of(&tok, n)).collect::<Result<Vec<_>, _>>()?;
    let want = reference(&prompts, MAX_TOKENS)?;
    // Bit-exactness, not timing: leases long enough for a 1,030-token prefill on one
    // thread of a loaded 2-core machine (see remote_prefill_matches_the_single_process_engine).
    let prefill = prefill_worker(GROUP, &["--transfer-timeout-ms", "120000"])?;
    let decode = decode_worker(
        GROUP,
        &["--kv-load-failure-policy", "fail", "--reservation-ttl-ms", "120000", "--kv-transport", transport],
    )?;
    let mut c = client(&decode).await?;
    let mut blocks = 0;
    for (i, p) in prompts.iter().enumerate() {
        let got = generate(&mut c, request(&format!("{transport}-{i}"), p, vec![target(&prefill)?])).await?;
        assert!(got.end.as_ref().is_ok_and(|f| f.prefilled_remotely), "{transport}: {got:?}");
        assert_eq!(got.tokens, want[i], "prompt of {} tokens over {transport}", p.len());
        blocks += p.len().div_ceil(16);
    }
    // Exported as each frame lands: exact once the answers are back, with no wait.
    let metrics = decode.addr("metrics")?;
    let page = scrape(&metrics).await?;
    assert_eq!(page.get(KV_RECEIVED_BYTES, &[])?, (blocks * 368_640) as f64);
    assert_eq!(page.get(KV_TRANSFERS_COMPLETED, &[])?, prompts.len() as f64);
    assert_eq!(page.get(TRANSPORT_INFO, &[("transport", transport)])?, 1.0);
    let ppage = scrape(&prefill.addr("metrics")?).await?;
    assert_eq!(ppage.get(KV_TRANSFER_BYTES, &[])?, (blocks * 368_640) as f64, "{transport}: bytes the sender counted");
    if transport == "ucx" {
        // Every transfer completed, so no landing range is held or quarantined.
        wait_metric(&metrics, UCX_LANDING_IN_USE, &[], |v| v == 0.0).await?;
        assert_eq!(scrape(&metrics).await?.get(UCX_QUARANTINED_RANGES, &[])?, 0.0);
    }
    assert_no_kv_left(transport, &decode).await
}

/// No certificate configured: the decode worker makes a self-signed one and
/// every destination carries its fingerprint for the prefill worker to pin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_over_quic_matches_the_engine() -> TestResult {
    remote_prefill_over("quic", &[37, 300]).await
}

/// Shared memory: a memfd ring passed over a Unix socket in the abstract namespace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_over_local_shared_memory_matches_the_engine() -> TestResult {
    remote_prefill_over("local", &[37, 300]).await
}

/// UCX: one-sided puts into the decode worker's landing region, with UCX's
/// transports from the environment (shared memory and CMA between two
/// processes on one host, unless `UCX_TLS` says otherwise); same greedy
/// tokens as the engine, and so as TCP, for a one-token prompt (one partial
/// block), 37 tokens (a partial last block) and 1,030 (65 blocks, 23 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_prefill_over_ucx_matches_the_engine() -> TestResult {
    remote_prefill_over("ucx", &[1, 37, 1030]).await
}

/// A decode worker (policy `fail`, always remote prefill, plus `extra`)
/// whose advertised transfer address is a fault proxy in front of its real
/// one, so the test can hold back or corrupt the KV prefill workers push.
fn decode_behind_proxy(extra: &[&str]) -> opskit::Result<(Worker, Proxy)> {
    let transfer = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| opskit::Error::Process(format!("pick a transfer port: {e}")))?;
    let proxy = Proxy::start(transfer)?;
    let (transfer_s, proxy_s) = (transfer.to_string(), proxy.addr.to_string());
    let mut args = vec!["--kv-load-failure-policy", "fail"];
    args.extend_from_slice(extra);
    args.extend(["--transfer", &transfer_s, "--advertise-transfer", &proxy_s]);
    Ok((decode_worker(GROUP, &args)?, proxy))
}

/// A prompt long enough that its KV (~7 MiB) is still streaming when the
/// proxy holds it back.
const FAULT_PROMPT: usize = 300;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_killed_mid_transfer_under_each_policy() -> TestResult {
    let tok = common::tokenizer()?;
    let prompt = prompt_of(&tok, FAULT_PROMPT)?;
    let want = reference(std::slice::from_ref(&prompt), MAX_TOKENS)?.remove(0);
    let backup = prefill_worker(GROUP, &[])?;
    // The proxy holds a doomed prefill worker's KV mid-stream.
    let (decode, proxy) = decode_behind_proxy(&[])?;
    let c = client(&decode).await?;

    for policy in [KvLoadFailurePolicy::Recompute, KvLoadFailurePolicy::Retry, KvLoadFailurePolicy::Fail] {
        let mut doomed = prefill_worker(GROUP, &[])?;
        proxy.arm(Fault::BufferAfter(1 << 20));
        let req = with_policy(
            request(&format!("kill-{policy:?}"), &prompt, vec![target(&doomed)?, target(&backup)?]),
            policy,
        );
        let mut c2 = c.clone();
        let call = tokio::spawn(async move { generate(&mut c2, req).await });
        // Mid-transfer: 1 MiB delivered, at least 1 MiB more held back.
        let p = proxy.clone();
        tokio::task::spawn_blocking(move || p.wait_buffered(1 << 20, WAIT)).await??;
        doomed.kill9().await?;
        proxy.release();
        let got = call.await??;
        // Each attempt is reported, so the coordinator's breakers can learn who failed.
        let (dead, alive) = (format!("pid-{}", doomed.pid), format!("pid-{}", backup.pid));
        let failed = got.attempts.first().filter(|(w, how)| *w == dead && how != "ok");
        assert!(failed.is_some(), "{policy:?}: the doomed worker's failure is reported: {:?}", got.attempts);
        let rest: Vec<_> = got.attempts[1..].iter().map(|(w, how)| (w.as_str(), how.as_str())).collect();
        match policy {
            KvLoadFailurePolicy::Retry => assert_eq!(rest, [(alive.as_str(), "ok")], "retry: {:?}", got.attempts),
            _ => assert!(rest.is_empty(), "{policy:?}: {:?}", got.attempts),
        }
        match policy {
            KvLoadFailurePolicy::Recompute => {
                assert_eq!(got.tokens, want, "recompute: {got:?}");
                assert!(got.end.as_ref().is_ok_and(|f| !f.prefilled_remotely), "recompute: {got:?}");
            }
            KvLoadFailurePolicy::Retry => {
                assert_eq!(got.tokens, want, "retry: {got:?}");
                assert!(got.end.as_ref().is_ok_and(|f| f.prefilled_remotely), "retry: {got:?}");
            }
            _ => {
                assert_eq!(kind(&got), Some(ErrorKind::KvLoadFailed), "fail: {got:?}");
                assert!(got.tokens.is_empty(), "fail: tokens before the error: {got:?}");
            }
        }
        assert_no_kv_left(&format!("{policy:?}"), &decode).await?;
    }
    let metrics = decode.addr("metrics")?;
    for (p, o) in [("recompute", "recomputed"), ("retry", "retried"), ("fail", "failed")] {
        wait_metric(&metrics, POLICY_OUTCOMES, &[("policy", p), ("outcome", o)], |v| v == 1.0).await?;
    }
    wait_metric(&metrics, KV_LOAD_FAILURES, &[("reason", "rpc")], |v| v == 3.0).await?;
    let mut b = backup;
    let bm = b.addr("metrics")?;
    assert_eq!(scrape(&bm).await?.get(facts::metrics::worker::KV_CACHE_USAGE, &[])?, 0.0, "the backup kept KV");
    b.signal(Signal::Term)?;
    assert_eq!(b.wait_exit(WAIT).await?.code(), Some(0));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_frame_is_refused_and_the_policy_applies() -> TestResult {
    let tok = common::tokenizer()?;
    let prompt = prompt_of(&tok, FAULT_PROMPT)?;
    let want = reference(std::slice::from_ref(&prompt), MAX_TOKENS)?.remove(0);
    let prefill = prefill_worker(GROUP, &[])?;
    let (decode, proxy) = decode_behind_proxy(&[])?;
    let mut c = client(&decode).await?;
    // 100 KiB into the stream: inside the first layer's payload.
    proxy.arm(Fault::FlipAfter(100 << 10));
    let got = generate(&mut c, request("corrupt-fail", &prompt, vec![target(&prefill)?])).await?;
    assert_eq!(kind(&got), Some(ErrorKind::KvLoadFailed), "{got:?}");
    assert!(got.tokens.is_empty(), "tokens from corrupt KV: {got:?}");
    let metrics = decode.addr("metrics")?;
    wait_metric(&metrics, KV_LOAD_FAILURES, &[("reason", "corrupt")], |v| v == 1.0).await?;
    assert_no_kv_left("after corruption", &decode).await?;

    proxy.arm(Fault::FlipAfter(100 << 10));
    let req =
        with_policy(request("corrupt-recompute", &prompt, vec![target(&prefill)?]), KvLoadFailurePolicy::Recompute);
    let got = generate(&mut c, req).await?;
    assert_eq!(got.tokens, want, "{got:?}");
    assert!(got.end.as_ref().is_ok_and(|f| !f.prefilled_remotely), "{got:?}");
    // The next, clean transfer on a fresh connection is used.
    let got = generate(&mut c, request("clean", &prompt, vec![target(&prefill)?])).await?;
    assert_eq!(got.tokens, want, "{got:?}");
    assert!(got.end.as_ref().is_ok_and(|f| f.prefilled_remotely), "{got:?}");
    assert!(proxy.counters().connections >= 3, "each corrupt transfer should drop its connection");
    assert_no_kv_left("after recompute", &decode).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_version_group_or_block_size_is_refused() -> TestResult {
    let tok = common::tokenizer()?;
    let prompt = prompt_of(&tok, 64)?;
    let other_group = prefill_worker("g2", &[])?;
    let other_blocks = prefill_worker(GROUP, &["--kv-block-size", "32"])?;
    let decode = decode_worker(GROUP, &["--kv-load-failure-policy", "fail"])?;
    let mut c = client(&decode).await?;
    for (name, p) in [("version group", &other_group), ("block size", &other_blocks)] {
        let got = generate(&mut c, request(name, &prompt, vec![target(p)?])).await?;
        assert_eq!(kind(&got), Some(ErrorKind::VersionMismatch), "{name}: {got:?}");
        assert!(got.tokens.is_empty());
    }
    let metrics = decode.addr("metrics")?;
    wait_metric(&metrics, KV_LOAD_FAILURES, &[("reason", "version_mismatch")], |v| v == 2.0).await?;
    // Refused before any KV connection (the destination names its group and layout).
    // Bytes that are not a frame end a connection with a reason of their own.
    let mut raw = tokio::net::TcpStream::connect(decode.addr("transfer")?).await?;
    tokio::io::AsyncWriteExt::write_all(&mut raw, &[0xA5; 256]).await?;
    wait_metric(&metrics, CONNECTIONS_CLOSED, &[("reason", "decode")], |v| v == 1.0).await?;
    let page = scrape(&metrics).await?;
    assert_eq!(page.get(KV_RECEIVED_BYTES, &[])?, 0.0, "KV crossed groups");
    assert_eq!(page.get(CONNECTIONS_ACCEPTED, &[])?, 1.0);
    assert_no_kv_left("after refusals", &decode).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_lease_frees_blocks_and_refuses_late_frames() -> TestResult {
    let tok = common::tokenizer()?;
    // Short: its prefill surely finishes and its KV (1.4 MiB) is sent within the lease.
    let prompt = prompt_of(&tok, 64)?;
    let prefill = prefill_worker(GROUP, &[])?;
    let (decode, proxy) = decode_behind_proxy(&["--reservation-ttl-ms", "5000"])?;
    let mut c = client(&decode).await?;
    // The handshake and a partial first frame pass; the rest waits past the lease.
    proxy.arm(Fault::BufferAfter(4096));
    let req = request("late", &prompt, vec![target(&prefill)?]);
    let call = tokio::spawn(async move { generate(&mut c, req).await });
    // Frames were sent within the lease and are held in the proxy.
    let p = proxy.clone();
    tokio::task::spawn_blocking(move || p.wait_buffered(64 << 10, WAIT)).await??;
    let got = call.await??;
    assert_eq!(kind(&got), Some(ErrorKind::KvLoadFailed), "{got:?}");
    assert!(got.tokens.is_empty());
    let metrics = decode.addr("metrics")?;
    wait_metric(&metrics, RESERVATIONS_EXPIRED, &[], |v| v == 1.0).await?;
    wait_metric(&metrics, KV_LOAD_FAILURES, &[("reason", "lease_expired")], |v| v == 1.0).await?;
    assert_no_kv_left("after expiry", &decode).await?;
    // The late frames arrive now and are refused, never written.
    proxy.release();
    wait_metric(&metrics, FRAMES_REFUSED, &[("reason", "expired")], |v| v >= 1.0).await?;
    assert_eq!(scrape(&metrics).await?.get(KV_TRANSFERS_COMPLETED, &[])?, 0.0);
    assert_no_kv_left("after late frames", &decode).await
}

fn unix_ms_in(d: Duration) -> u64 {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |n| n.as_millis() as u64);
    now + d.as_millis() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_shorter_than_prefill_is_a_typed_error_and_frees_everything() -> TestResult {
    let tok = common::tokenizer()?;
    let prompt = prompt_of(&tok, 1030)?;
    let prefill = prefill_worker(GROUP, &[])?;
    let decode = decode_worker(GROUP, &["--kv-load-failure-policy", "recompute"])?;
    let mut c = client(&decode).await?;
    let mut req = request("tight", &prompt, vec![target(&prefill)?]);
    req.deadline_unix_ms = unix_ms_in(Duration::from_millis(100));
    let started = std::time::Instant::now();
    let got = generate(&mut c, req).await?;
    assert_eq!(kind(&got), Some(ErrorKind::Deadline), "{got:?}");
    assert!(got.tokens.is_empty());
    assert!(started.elapsed() < Duration::from_secs(10), "the deadline error took {:?}", started.elapsed());
    assert_no_kv_left("decode after deadline", &decode).await?;
    // The prefill worker stops and frees its KV too.
    let mut pc = proto::worker::v1::prefill_worker_client::PrefillWorkerClient::connect(format!(
        "http://{}",
        prefill.addr("grpc")?
    ))
    .await?;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    let waited = within("prefill worker idle", async {
        loop {
            tick.tick().await;
            let h = pc.health(HealthRequest::default()).await?.into_inner();
            if h.kv_blocks_used == 0 && h.running == 0 && h.waiting == 0 {
                return Ok::<_, tonic::Status>(h);
            }
        }
    })
    .await??;
    assert_eq!(waited.kv_blocks_used, 0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_in_flight_requests() -> TestResult {
    let tok = common::tokenizer()?;
    let prefill = prefill_worker(GROUP, &[])?;
    // A grace far longer than the drain takes on a quiet machine (~2 s): the test is
    // that in-flight requests finish, not how fast; the default 10 s ran out on a
    // 2-core machine shared with other builds (request 0 at 15 of 24 tokens).
    let args = ["--kv-load-failure-policy", "fail", "--shutdown-timeout-ms", "60000"];
    let mut decode = decode_worker(GROUP, &args)?;
    let c = client(&decode).await?;
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt_of(&tok, 40 + i)).collect::<Result<_, _>>()?;
    let want = reference(&prompts, 24)?;
    let mut calls = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut req = request(&format!("drain-{i}"), p, vec![target(&prefill)?]);
        req.sampling = Some((&common::greedy(24)).into());
        let mut c = c.clone();
        calls.push(tokio::spawn(async move { generate(&mut c, req).await }));
    }
    // Every request is in flight (waiting for KV or decoding) before the signal.
    wait_metric(&decode.addr("metrics")?, PREFILL_ROUTE, &[("route", "remote")], |v| v == 4.0).await?;
    decode.signal(Signal::Term)?;
    for (i, call) in calls.into_iter().enumerate() {
        let got = call.await??;
        assert!(got.end.is_ok(), "request {i} did not finish across SIGTERM: {got:?}");
        assert_eq!(got.tokens, want[i], "request {i}");
    }
    let exit = decode.wait_exit(WAIT).await?;
    assert_eq!(exit.code(), Some(0), "decode worker exit after SIGTERM: {exit:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_buffer_requests_are_refused_as_overloaded() -> TestResult {
    let tok = common::tokenizer()?;
    let decode =
        decode_worker(GROUP, &["--kv-load-failure-policy", "fail", "--max-running", "1", "--max-waiting", "1"])?;
    let c = client(&decode).await?;
    let prompt = prompt_of(&tok, 8)?;
    // One running and one waiting fill the worker; a long generation keeps them there.
    let mut long = Vec::new();
    for i in 0..2 {
        let mut req = request(&format!("long-{i}"), &prompt, vec![]);
        req.sampling = Some((&common::greedy(150)).into());
        let mut c = c.clone();
        long.push(tokio::spawn(async move { generate(&mut c, req).await }));
    }
    let mut hc = c.clone();
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    within("one running and one waiting", async {
        loop {
            tick.tick().await;
            let h = hc.health(HealthRequest::default()).await?.into_inner();
            if h.running == 1 && h.waiting == 1 {
                return Ok::<_, tonic::Status>(());
            }
        }
    })
    .await??;
    let mut c3 = c.clone();
    let got = generate(&mut c3, request("third", &prompt, vec![])).await?;
    assert_eq!(kind(&got), Some(ErrorKind::Overloaded), "{got:?}");
    for call in long {
        let got = call.await??;
        assert!(got.end.is_ok(), "{got:?}");
    }
    assert_no_kv_left("after overload", &decode).await
}

/// A KV pool too small for the batch's growth makes the engine preempt
/// (evict by recompute); the decode worker exports the count as
/// `tandem_num_preemptions_total{reason="kv_exhausted"}` and in its Health
/// reply, and every request still ends with all its tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preemptions_under_a_tiny_kv_pool_are_exported() -> TestResult {
    // 8 blocks of 16 tokens; four requests of ~20 prompt + 40 generated tokens need 16.
    let w = decode_worker(GROUP, &["--kv-blocks", "8", "--kv-load-failure-policy", "recompute"])?;
    let tok = common::tokenizer()?;
    let (preemptions, reason) =
        (facts::metrics::worker::PREEMPTIONS, [("reason", facts::metrics::worker::PREEMPTION_KV_EXHAUSTED)]);
    let metrics = w.addr("metrics")?;
    assert_eq!(scrape(&metrics).await?.get(preemptions, &reason)?, 0.0, "the series exists, at 0, before any request");
    let mut runs = Vec::new();
    for (i, n) in [17, 19, 21, 23].into_iter().enumerate() {
        let mut c = client(&w).await?;
        let mut req = request(&format!("p{i}"), &prompt_of(&tok, n)?, Vec::new());
        req.sampling = Some((&common::greedy(40)).into());
        runs.push(tokio::spawn(async move { generate(&mut c, req).await }));
    }
    for r in runs {
        let o = r.await??;
        let f = o.end.map_err(|e| format!("a request failed: {e:?}"))?;
        assert_eq!((o.tokens.len(), f.generated_tokens), (40, 40), "every request ends with all its tokens");
    }
    let mut c = client(&w).await?;
    let h = within("Health", c.health(HealthRequest::default())).await??.into_inner();
    assert!(h.preemptions > 0, "16 blocks of demand on an 8-block pool preempted nothing: {h:?}");
    let exported = wait_metric(&metrics, preemptions, &reason, |v| v > 0.0).await?;
    assert_eq!(exported, h.preemptions as f64, "the metric and Health agree");
    assert_no_kv_left("after preemptions", &w).await
}

/// Health answers from the runner's last snapshot while the runner is in a
/// long step, instead of waiting the step out: a decode worker prefilling an
/// 800-token prompt in one engine step (seconds on one thread; well under
/// the 30 s after which a silent runner counts as stuck) still answers
/// every poll fast, ready, with its figures. A frozen worker (SIGSTOP)
/// answers nothing, and only that is what the coordinator takes for stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_answers_from_the_last_snapshot_during_a_long_step() -> TestResult {
    // The bound on one Health answer: the worker waits 50 ms for the runner,
    // then answers; the rest is slack for two shared cores (814 ms seen
    // with another worker prefilling beside it).
    const HEALTH_BOUND: Duration = Duration::from_secs(1);
    let tok = common::tokenizer()?;
    // One step for the whole prompt (the default budget is 512 tokens). 300 tokens
    // took 1.5 s on a quick machine (AMD EPYC): too short to tell the two apart.
    let w = decode_worker(GROUP, &["--kv-load-failure-policy", "fail", "--max-batch-tokens", "1024"])?;
    let mut c = client(&w).await?;
    // The coordinator polls from the start; so the snapshot exists before any step.
    let first = within("Health", c.health(HealthRequest::default())).await??.into_inner();
    assert!(first.ready && first.kv_blocks_total == 256, "{first:?}");
    let mut req = request("long", &prompt_of(&tok, 800)?, vec![]);
    req.sampling = Some((&common::greedy(1)).into());
    let mut gc = c.clone();
    let started = std::time::Instant::now();
    let call = tokio::spawn(async move { generate(&mut gc, req).await });
    let mut answers = Vec::new();
    while !call.is_finished() {
        let asked = std::time::Instant::now();
        let h = within("Health", c.health(HealthRequest::default())).await??.into_inner();
        answers.push((asked.elapsed(), h));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let step = started.elapsed();
    let got = call.await??;
    assert!(got.end.is_ok(), "{got:?}");
    let mut took: Vec<Duration> = answers.iter().map(|(t, _)| *t).collect();
    took.sort();
    let (median, slowest) = (took.get(took.len() / 2).copied(), took.last().copied());
    eprintln!("health: {} answers during a {step:?} prefill, median {median:?}, slowest {slowest:?}", took.len());
    // Else the step was too short to tell waiting from not waiting.
    assert!(step > HEALTH_BOUND * 2, "the 800-token prefill took only {step:?}");
    for (took, h) in &answers {
        assert!(*took <= HEALTH_BOUND, "a Health answer took {took:?} during a {step:?} step: {h:?}");
        assert!(h.ready && h.live && h.kv_blocks_total == 256, "{h:?}");
    }
    assert!(answers.len() >= 3, "{} answers during a {step:?} step", answers.len());
    Ok(())
}

/// A prompt queued on a busy prefill worker keeps its reservation however long the queue
/// takes, and loses it one lease after the worker stops answering. The prefill worker's
/// whole KV pool is held by another prompt (`hold_prefill_worker`), so a request routed
/// there waits in its queue; the decode worker's lease is 1.5 s. While the prefill worker
/// answers `PrefillStatus` with QUEUED the lease is renewed (three renewals: over a lease
/// and a half of waiting), and once the holder goes the request completes with the engine's
/// output and no failed load. A second queued request's prefill worker is then stopped
/// (SIGSTOP): renewals stop, the load fails as `lease_expired` (policy `fail`), and no KV
/// stays reserved. Before renewals, a queue wait over the lease always failed the load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_queued_on_a_busy_prefill_worker_keeps_its_lease_until_the_worker_goes_silent() -> TestResult {
    use facts::metrics::decode::LEASE_RENEWALS;
    let tok = common::tokenizer()?;
    let holder = prompt_of(&tok, 64)?;
    let prompt = prompt_of(&tok, 40)?;
    let want = reference(std::slice::from_ref(&prompt), MAX_TOKENS)?;
    let blocks = holder.len().div_ceil(16).to_string();
    let prefill = prefill_worker(GROUP, &["--kv-blocks", &blocks, "--transfer-timeout-ms", "600000"])?;
    let args = ["--kv-load-failure-policy", "fail", "--reservation-ttl-ms", "1500"];
    let decode = decode_worker(GROUP, &args)?;
    let metrics = decode.addr("metrics")?;
    let c = client(&decode).await?;
    let silent = std::net::TcpListener::bind("127.0.0.1:0")?;

    // 1. Queued behind the holder for three renewals, then served once the holder goes.
    let held = hold_prefill_worker(&prefill, "holder-1", &holder, &silent).await?;
    let mut req = request("queued", &prompt, vec![target(&prefill)?]);
    req.cache_salt = 7; // none of the holder's blocks to share
    let mut call = tokio::spawn({
        let mut c = c.clone();
        async move { generate(&mut c, req).await }
    });
    tokio::select! {
        renewed = wait_metric(&metrics, LEASE_RENEWALS, &[], |v| v >= 3.0) => drop(renewed?),
        ended = &mut call => return Err(format!("the request ended while its prompt was queued: {ended:?}").into()),
    }
    held.abort();
    let got = call.await??;
    let fin = got.end.as_ref().map_err(|e| format!("the queued request failed: {e:?}"))?;
    assert!(fin.prefilled_remotely, "{got:?}");
    assert_eq!(got.tokens, want[0], "the queued prompt's output differs from the engine's");
    let page = scrape(&metrics).await?;
    assert_eq!(page.sum(KV_LOAD_FAILURES, &[])?, 0.0, "a load failed while its prompt waited");
    assert_eq!(page.get(RESERVATIONS_EXPIRED, &[])?, 0.0);
    assert_no_kv_left("after the queued request", &decode).await?;

    // 2. Queued again; the prefill worker stops answering: the lease runs out.
    let held = hold_prefill_worker(&prefill, "holder-2", &holder, &silent).await?;
    let renewed = scrape(&metrics).await?.get(LEASE_RENEWALS, &[])?;
    let mut req = request("stranded", &prompt, vec![target(&prefill)?]);
    req.cache_salt = 7;
    let call = tokio::spawn({
        let mut c = c.clone();
        async move { generate(&mut c, req).await }
    });
    wait_metric(&metrics, LEASE_RENEWALS, &[], |v| v > renewed).await?;
    prefill.signal(Signal::Stop)?;
    let got = call.await??;
    assert_eq!(kind(&got), Some(ErrorKind::KvLoadFailed), "{got:?}");
    wait_metric(&metrics, KV_LOAD_FAILURES, &[("reason", "lease_expired")], |v| v == 1.0).await?;
    assert_no_kv_left("after the stranded request", &decode).await?;
    prefill.signal(Signal::Cont)?;
    held.abort();
    drop(silent);
    Ok(())
}

/// A worker scraped while it exits exits cleanly: SIGTERM with eight clients scraping
/// `/metrics` back to back, six rounds; exit status 0 and no panic in its log. Dropping
/// the runtime at exit cancelled the Prometheus exporter's render mid-scrape, and the
/// exporter unwraps it: a panic in the log (the version-relabel drill's G5, once in a
/// `make test`). The race is narrow, so a pass here says little alone; a failure is the bug.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_scraped_while_it_exits_exits_cleanly() -> TestResult {
    use std::sync::atomic::{AtomicBool, Ordering};
    for round in 0..6 {
        let log = std::env::temp_dir().join(format!("tandem-scrape-exit-{}-{round}.log", std::process::id()));
        let mut decode = common::decode_worker_logged(GROUP, &["--kv-load-failure-policy", "retry"], &log)?;
        let metrics = decode.addr("metrics")?;
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let scrapers: Vec<_> = (0..8)
            .map(|_| {
                let (addr, stop) = (metrics.clone(), stop.clone());
                tokio::spawn(async move {
                    let mut served = 0u32;
                    while !stop.load(Ordering::Relaxed) {
                        if opskit::prom::scrape_within(&addr, Duration::from_millis(500)).await.is_ok() {
                            served += 1;
                        }
                    }
                    served
                })
            })
            .collect();
        scrape(&metrics).await?;
        decode.signal(opskit::process::Signal::Term)?;
        let status = decode.wait_exit(Duration::from_secs(30)).await?;
        stop.store(true, Ordering::Relaxed);
        let mut served = 0;
        for s in scrapers {
            served += s.await?;
        }
        let text = std::fs::read_to_string(&log)?;
        let _ = std::fs::remove_file(&log);
        assert!(status.success(), "round {round}: exit {status:?}");
        assert!(!text.contains("panicked"), "round {round}: a panic in the log:\n{text}");
        assert!(served > 0, "round {round}: no scrape was served");
    }
    Ok(())
}
