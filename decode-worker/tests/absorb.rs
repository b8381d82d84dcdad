//! A real `tandem-decode-worker` beside a prefill worker that refuses every
//! request as overloaded: under `recompute` the decode worker absorbs those
//! prompts itself up to its budget (`--max-absorbed-prefill-tokens-per-s`,
//! `src/absorb.rs`) and refuses the rest as `overloaded`, counted and logged,
//! while a stream already running there keeps its pace.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;
#[path = "common/rpc.rs"]
mod rpc;

use std::time::Duration;

use common::{prefill_worker, prompt_of, scrape, wait_metric, within, TestResult};
use facts::metrics::decode::POLICY_OUTCOMES;
use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
use proto::worker::v1::{generate_response, ErrorKind, GenerateRequest, HealthRequest};
use rpc::{client, generate, request, target, GROUP, MAX_TOKENS};
use tonic::transport::Channel;

/// The overload test's absorb budget, prompt and flood.
const ABSORB_TOKENS_PER_S: u64 = 32;
const ABSORB_PROMPT: usize = 64;
const FLOOD: usize = 8;
/// The most a stream already running on the decode worker may wait between
/// two tokens while overloaded requests are absorbed or refused beside it.
/// Generous on purpose: an engine step that carries one absorbed 64-token
/// prefill takes well under a second on an idle core, but the test shares
/// two cores with whatever else runs (beside the rest of the suite a
/// 100-token one was seen at 5.8 s, with the stream's own steps at 75 ms
/// instead of 25 ms). The whole flood absorbed would be a 512-token step.
const ABSORB_GAP_BOUND: Duration = Duration::from_secs(10);

/// A Generate stream's token arrival times, read until `stop` fires (then the
/// stream is dropped, which cancels the request) or the stream ends.
async fn timed(
    c: &mut DecodeWorkerClient<Channel>,
    req: GenerateRequest,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Result<Vec<std::time::Instant>, String> {
    let id = req.request_id.clone();
    let mut stream = c.generate(req).await.map_err(|s| format!("Generate {id}: {s}"))?.into_inner();
    let mut times = Vec::new();
    loop {
        let msg = tokio::select! {
            m = stream.message() => m.map_err(|s| format!("Generate {id} stream: {s}"))?,
            _ = &mut stop => return Ok(times),
        };
        match msg.and_then(|m| m.event) {
            Some(generate_response::Event::Token(_)) => times.push(std::time::Instant::now()),
            Some(generate_response::Event::Finished(_)) => return Ok(times),
            other => return Err(format!("Generate {id} ended with {other:?} after {} tokens", times.len())),
        }
    }
}

/// Under `recompute`, a prefill worker refusing as overloaded (one with
/// `--max-waiting 0` refuses every request) is an explicit decision, counted
/// and logged: the decode worker prefills the prompt itself while its absorb
/// budget lasts (`--max-absorbed-prefill-tokens-per-s`), and refuses the rest
/// at once as `overloaded`. A stream already running there keeps its pace:
/// no gap between its tokens over [`ABSORB_GAP_BOUND`] meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overloaded_prefill_worker_is_absorbed_up_to_the_cap_then_refused() -> TestResult {
    let tok = common::tokenizer()?;
    let refusing = prefill_worker(GROUP, &["--max-waiting", "0"])?;
    let log = std::env::temp_dir().join(format!("tandem-absorb-{}.log", std::process::id()));
    let rate = ABSORB_TOKENS_PER_S.to_string();
    let args = ["--kv-load-failure-policy", "recompute", "--max-absorbed-prefill-tokens-per-s", &rate];
    let decode = common::decode_worker_logged(GROUP, &args, &log)?;
    let c = client(&decode).await?;
    let metrics = decode.addr("metrics")?;

    // A stream running here (no prefill worker named: prefilled locally), its tokens timed.
    let mut req = request("running", &prompt_of(&tok, 8)?, vec![]);
    req.sampling = Some((&common::greedy(4000)).into());
    let (stop, stopped) = tokio::sync::oneshot::channel();
    let mut c1 = c.clone();
    let running = tokio::spawn(async move { timed(&mut c1, req, stopped).await });
    wait_metric(&metrics, facts::metrics::decode::GENERATION_TOKENS, &[], |v| v >= 10.0).await?;

    let prompt = prompt_of(&tok, ABSORB_PROMPT)?;
    let flood_started = std::time::Instant::now();
    let mut calls = Vec::new();
    for i in 0..FLOOD {
        let (mut c, req) = (c.clone(), request(&format!("flood-{i}"), &prompt, vec![target(&refusing)?]));
        calls.push(tokio::spawn(async move { generate(&mut c, req).await }));
    }
    let (mut absorbed, mut refused) = (Vec::new(), Vec::new());
    let busy = vec![(format!("pid-{}", refusing.pid), "prefill_error".to_owned())];
    for (i, call) in calls.into_iter().enumerate() {
        let got = call.await??;
        assert_eq!(got.attempts, busy, "flood-{i}: the refusing worker's attempt is reported: {got:?}");
        match &got.end {
            Ok(f) => {
                assert!(!f.prefilled_remotely && got.tokens.len() == MAX_TOKENS as usize, "flood-{i}: {got:?}");
                absorbed.push(i);
            }
            Err(e) if e.kind() == ErrorKind::Overloaded => {
                assert!(got.tokens.is_empty(), "flood-{i}: tokens before the refusal: {got:?}");
                refused.push(i);
            }
            Err(e) => return Err(format!("flood-{i} ended with {e:?}, neither absorbed nor refused").into()),
        }
    }
    let flood = flood_started.elapsed();
    stop.send(()).map_err(|_| "the running stream ended before the flood was over")?;
    let times = running.await??;

    // The cap holds: at most rate x (1 s + the flood's duration) tokens, plus one prompt.
    let bound = ABSORB_TOKENS_PER_S as f64 * (1.0 + flood.as_secs_f64()) + ABSORB_PROMPT as f64;
    let taken = (absorbed.len() * ABSORB_PROMPT) as f64;
    assert!(taken <= bound, "absorbed {absorbed:?} ({taken} tokens) in {flood:?}; the cap allows {bound}");
    assert!(!absorbed.is_empty() && !refused.is_empty(), "absorbed {absorbed:?}, refused {refused:?}");

    // Counted, under their own outcome labels.
    for (outcome, n) in [
        (facts::metrics::decode::OUTCOME_OVERLOAD_ABSORBED, absorbed.len()),
        (facts::metrics::decode::OUTCOME_OVERLOAD_REFUSED, refused.len()),
    ] {
        wait_metric(&metrics, POLICY_OUTCOMES, &[("policy", "recompute"), ("outcome", outcome)], |v| v == n as f64)
            .await?;
    }
    // Rendered from its first increment: the family is exported (read just above), the plain
    // recompute outcome must not be among it.
    let plain = [("policy", "recompute"), ("outcome", facts::metrics::decode::OUTCOME_RECOMPUTED)];
    assert_eq!(
        scrape(&metrics).await?.absent_as_zero(POLICY_OUTCOMES, &plain),
        0.0,
        "an overload is not a plain recompute"
    );

    // Logged: one line per decision naming the request, the prefill worker and the reason.
    let text = std::fs::read_to_string(&log)?;
    let addr = refusing.addr("grpc")?.to_string();
    for (ids, what) in [(&absorbed, "(absorbed)"), (&refused, "refusing as overloaded")] {
        for i in ids {
            let request = format!("request=flood-{i} ");
            let line = text.lines().find(|l| l.contains(&request) && l.contains(what));
            assert!(
                line.is_some_and(|l| l.contains(&addr) && l.contains("reason=overloaded")),
                "no log line for flood-{i} {what} naming {addr} and the reason in {}:\n{text}",
                log.display()
            );
        }
    }

    // The running stream kept its pace while the flood was absorbed or refused.
    let window: Vec<Duration> = times
        .windows(2)
        .filter(|w| w[1] >= flood_started && w[0] <= flood_started + flood)
        .map(|w| w[1] - w[0])
        .collect();
    let before: Vec<Duration> = times.windows(2).filter(|w| w[1] < flood_started).map(|w| w[1] - w[0]).collect();
    let median = |v: &[Duration]| {
        let mut v = v.to_vec();
        v.sort();
        v.get(v.len() / 2).copied().unwrap_or_default()
    };
    let max = window.iter().max().copied().unwrap_or_default();
    eprintln!(
        "absorb: {} absorbed, {} refused in {flood:?}; running stream: median gap {:?} before, {:?} during \
         ({} gaps), max {max:?}",
        absorbed.len(),
        refused.len(),
        median(&before),
        median(&window),
        window.len()
    );
    assert!(!window.is_empty(), "the running stream produced no token during the flood");
    assert!(max <= ABSORB_GAP_BOUND, "the running stream stalled {max:?} (bound {ABSORB_GAP_BOUND:?})");
    let _ = std::fs::remove_file(&log);
    drop(refusing);
    // The cancelled stream's blocks are freed once the worker sees it go.
    let mut hc = client(&decode).await?;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    within("the decode worker's KV freed", async {
        loop {
            tick.tick().await;
            let h = hc.health(HealthRequest::default()).await?.into_inner();
            if h.kv_blocks_used == 0 && h.running == 0 {
                return Ok::<_, tonic::Status>(());
            }
        }
    })
    .await??;
    Ok(())
}
