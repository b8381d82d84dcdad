//! The real `tandem-prefill-worker` process against an in-test decode side:
//! a KvPool, a kvtransfer Receiver and a TcpKvServer on loopback. The first
//! token and the KV it pushes must equal a single-process engine's, bit for bit.
//!
//! It also reads the worker's Prometheus `/metrics`, by the exported names.
//!
//! Every wait is bounded and says what did not happen; nothing sleeps. Processes, metric
//! pages and waits are opskit's.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine::batch::{Engine, EngineConfig, Request};
use engine::kv::KvPool;
use engine::model::Model;
use engine::tokenizer::Tokenizer;
use engine::weights::Weights;
use facts::metrics::prefill::{
    KV_LAYERS_SENT, KV_STALE_CONNECTIONS, KV_TRANSFER_BYTES, KV_TRANSFER_FAILURES, KV_TRANSFER_SECONDS,
    PREFILL_REQUESTS, PREFILL_SECONDS, PROMPT_TOKENS,
};
use facts::metrics::worker::{KV_BLOCKS_USED, KV_CACHE_USAGE};
use kvtransfer::{
    LayoutFingerprint, Peer, Receiver, ReceiverConfig, Reservation, ReservationId, TcpKvServer, TcpServerConfig,
    VersionGroup,
};
use opskit::process::{Launch, Proc, Signal};
use proto::worker::v1::prefill_worker_client::PrefillWorkerClient;
use proto::worker::v1::{prefill_response, ErrorKind, HealthRequest, KvDestination, PrefillRequest};
use types::kv::{KvDtype, KvLayout};
use types::sampling::SamplingParams;

type TestResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// Model loading on a busy 2-core machine; a hang hits this.
const WAIT: Duration = Duration::from_secs(120);

/// Awaits `fut` for at most [`WAIT`]; the error says `what` did not happen.
async fn within<T>(what: &str, fut: impl Future<Output = T>) -> opskit::Result<T> {
    opskit::within(what, WAIT, fut).await
}

/// This package's worker with `args`, once it printed its gRPC and metrics addresses.
fn worker(args: &[&str]) -> opskit::Result<Proc> {
    Launch::path(env!("CARGO_BIN_EXE_tandem-prefill-worker"))
        .args(args)
        .wants(&["grpc", "metrics"])
        .wait(WAIT)
        .start_blocking()
}

const GROUP: &str = "test-group";

/// [`worker`] on loopback in [`GROUP`] with one thread and [`KV_BLOCKS`], plus `extra`.
fn one_thread_worker(extra: &[&str]) -> opskit::Result<Proc> {
    let kv_blocks = KV_BLOCKS.to_string();
    let mut args = vec!["--grpc", "127.0.0.1:0", "--version-group", GROUP, "--threads", "1", "--kv-blocks", &kv_blocks];
    args.extend_from_slice(extra);
    worker(&args)
}
const KV_BLOCKS: usize = 64;

fn engine_config() -> EngineConfig {
    EngineConfig { kv_blocks: KV_BLOCKS, ..EngineConfig::default() }
}

/// Local reference: layout, fingerprint, the greedy first token and the prompt's KV bytes.
fn reference(prompt: &[u32]) -> Result<(KvLayout, LayoutFingerprint, u32, Vec<u8>), String> {
    let path = engine::paths::default_model_path();
    let (w, f) = Weights::from_gguf(&path).map_err(|e| format!("load {}: {e}", path.display()))?;
    let tok = Tokenizer::from_gguf(&f).map_err(|e| e.to_string())?;
    let model = Model::new(w, 1).map_err(|e| e.to_string())?;
    let layout = model.kv_layout(16, KvDtype::F16);
    let digest = engine::weights::digest::weights_digest(&path).map_err(|e| e.to_string())?;
    let fp = LayoutFingerprint::new(&layout, &digest, &tok.digest());
    let mut e = Engine::new(model, engine_config(), tok.eos_ids().to_vec()).map_err(|e| e.to_string())?;
    e.add_prefill_only(Request {
        id: 7,
        prompt: prompt.to_vec(),
        params: greedy(),
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    })
    .map_err(|e| e.to_string())?;
    let mut first = None;
    for _ in 0..10_000 {
        if !e.has_work() {
            break;
        }
        for ev in e.step().map_err(|e| e.to_string())? {
            first = Some(ev.token.id);
        }
    }
    let first = first.ok_or("the local engine produced no first token")?;
    let blocks = e.held_blocks(7).ok_or("the local engine holds no blocks")?.to_vec();
    let kv = e.pool().gather(&blocks).map_err(|e| e.to_string())?;
    Ok((layout, fp, first, kv))
}

fn greedy() -> SamplingParams {
    SamplingParams { max_tokens: 1, ignore_eos: true, ..SamplingParams::default() }
}

fn prompt() -> Result<Vec<u32>, String> {
    let path = engine::paths::default_model_path();
    let (_, f) = Weights::from_gguf(&path).map_err(|e| e.to_string())?;
    let tok = Tokenizer::from_gguf(&f).map_err(|e| e.to_string())?;
    let text =
        "The quick brown fox jumps over the lazy dog. The capital of France is Paris, and the capital of Germany is";
    tok.encode(text, false).map_err(|e| e.to_string())
}

/// [`prompt`]'s tokens over and over, `n` of them.
fn long_prompt(n: usize) -> Result<Vec<u32>, String> {
    Ok(prompt()?.into_iter().cycle().take(n).collect())
}

/// A tcp destination in [`GROUP`] with layout `fp`: reservation `r`'s `blocks` at `addr`.
fn tcp_destination(addr: String, fp: LayoutFingerprint, r: Reservation, blocks: Vec<u32>) -> KvDestination {
    KvDestination {
        transfer_addr: addr,
        transport: "tcp".into(),
        reservation_id: r.id.0,
        generation: r.generation,
        block_ids: blocks,
        layout_fingerprint: fp.as_bytes().to_vec(),
        version_group: GROUP.into(),
        tls_cert_sha256: vec![],
    }
}

/// A greedy one-token prefill of `tokens` under cache salt `salt`, no deadline,
/// pushing its KV to `destination`.
fn prefill_request(id: &str, tokens: &[u32], salt: u64, destination: KvDestination) -> PrefillRequest {
    PrefillRequest {
        request_id: id.into(),
        token_ids: tokens.to_vec(),
        sampling: Some((&greedy()).into()),
        deadline_unix_ms: 0,
        cache_salt: salt,
        priority: 0,
        destination: Some(destination),
        generated_ids: Vec::new(),
        determinism_fingerprint: Vec::new(),
    }
}

/// A destination whose kernel accepts the connection and which never answers the
/// handshake: a transfer to it waits (`silent` listens there), and the prompt's KV
/// stays held on the worker until its caller goes away.
fn silent_destination(
    silent: &std::net::TcpListener,
    fp: LayoutFingerprint,
    blocks: usize,
) -> std::io::Result<KvDestination> {
    let r = Reservation { id: ReservationId(1), generation: 1 };
    Ok(tcp_destination(silent.local_addr()?.to_string(), fp, r, (0..blocks as u32).collect()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_pushes_bit_exact_kv_and_exits_cleanly_on_sigterm() -> TestResult {
    // Two steps of the engine's 512 tokens: the first step's layers go gathered, the
    // last step's straight from the pool (`Pin` in the service), and the bytes are one.
    let prompt = long_prompt(600)?;
    let (layout, fp, want_first, want_kv) = reference(&prompt)?;
    let mut worker = one_thread_worker(&[])?;
    let (addr, metrics_addr) = (worker.addr("grpc")?, worker.addr("metrics")?);

    // The decode side.
    let local = Peer { version_group: VersionGroup::new(GROUP)?, fingerprint: fp };
    let rx = Arc::new(Mutex::new(Receiver::new(local, ReceiverConfig::new(layout))?));
    let pool = Arc::new(Mutex::new(KvPool::new(layout, KV_BLOCKS)?));
    let n = prompt.len().div_ceil(layout.block_size);
    let blocks = {
        let mut p = pool.lock().map_err(|_| "pool lock")?;
        let _decoys = p.allocate(3)?;
        p.allocate(n)?
    };
    let r = rx.lock().map_err(|_| "rx lock")?.reserve(
        blocks.clone(),
        Duration::from_secs(120),
        tokio::time::Instant::now(),
    )?;
    let server = TcpKvServer::bind("127.0.0.1:0", rx.clone(), pool.clone(), TcpServerConfig::default()).await?;

    let mut client = within("gRPC connect", PrefillWorkerClient::connect(format!("http://{addr}"))).await??;
    let destination = tcp_destination(server.local_addr().to_string(), fp, r, blocks.clone());
    let request = prefill_request("req-1", &prompt, 0, destination.clone());
    let resp = within("Prefill answer", client.prefill(request.clone())).await??.into_inner();
    let Some(prefill_response::Outcome::FirstToken(first)) = resp.outcome else {
        return Err(format!("Prefill did not return a first token: {resp:?}").into());
    };
    assert_eq!(first.id, want_first, "first token differs from the single-process engine");
    assert_eq!(first.kv_layers_sent as usize, layout.n_layers);
    assert_eq!(first.kv_bytes_sent as usize, want_kv.len());

    let ready = rx.lock().map_err(|_| "rx lock")?.take_ready(r)?;
    assert_eq!(ready, blocks);
    let got = pool.lock().map_err(|_| "pool lock")?.gather(&ready)?;
    assert!(got == want_kv, "received KV differs from the local engine's ({} vs {} bytes)", got.len(), want_kv.len());

    // The answer goes out before the runner takes the release of the prompt's blocks
    // (between steps: at once here, idle), so the worker holds them for a moment after.
    let health = opskit::poll("the worker releasing the prompt's KV", WAIT, || {
        let mut c = client.clone();
        async move {
            let h = c.health(HealthRequest::default()).await.map_err(|e| e.to_string())?.into_inner();
            Ok::<_, String>((h.kv_blocks_used == 0).then_some(h))
        }
    })
    .await?;
    assert!(health.live && health.ready, "{health:?}");
    assert_eq!(health.kv_blocks_total as usize, KV_BLOCKS, "{health:?}");
    assert_eq!(health.layout_fingerprint, fp.as_bytes().to_vec());
    assert_eq!(health.version_group, GROUP);

    // A destination with another fingerprint is refused before any work.
    let mut wrong = request.clone();
    wrong.request_id = "req-2".into();
    if let Some(d) = wrong.destination.as_mut() {
        d.layout_fingerprint = vec![0x5a; 32];
    }
    let resp = within("Prefill answer (wrong fingerprint)", client.prefill(wrong)).await??.into_inner();
    match resp.outcome {
        Some(prefill_response::Outcome::Error(e)) => assert_eq!(e.kind(), ErrorKind::VersionMismatch, "{e:?}"),
        other => return Err(format!("expected VERSION_MISMATCH, got {other:?}").into()),
    }

    // Both answers are counted before they are sent, so one scrape sees them.
    let page = opskit::prom::scrape_within(&metrics_addr, WAIT).await?;
    assert_eq!(page.get(KV_TRANSFER_BYTES, &[])?, first.kv_bytes_sent as f64);
    assert_eq!(page.get(PREFILL_REQUESTS, &[("outcome", "ok")])?, 1.0);
    assert_eq!(page.get(PREFILL_REQUESTS, &[("outcome", "version_mismatch")])?, 1.0);
    assert_eq!(page.get(PROMPT_TOKENS, &[])?, prompt.len() as f64);
    assert_eq!(page.get(&format!("{KV_TRANSFER_SECONDS}_count"), &[])?, 1.0);
    assert_eq!(page.get(&format!("{PREFILL_SECONDS}_count"), &[])?, 1.0);
    assert_eq!(page.get(KV_CACHE_USAGE, &[])?, 0.0, "the worker kept KV");
    // tcp, `--tcp-pinned` by default: the last step's layers written straight from the
    // pool's blocks, the first step's (which preemption could have freed) gathered.
    assert_eq!(page.get(KV_LAYERS_SENT, &[("path", "pinned")])?, layout.n_layers as f64);
    assert_eq!(page.get(KV_LAYERS_SENT, &[("path", "gathered")])?, layout.n_layers as f64);
    for h in [KV_TRANSFER_SECONDS, PREFILL_SECONDS] {
        assert!(page.has(&format!("{h}_bucket")), "{h} is not rendered as a histogram: {:?}", page.samples());
        assert!(!page.series(h).any(|s| s.labels.contains_key("quantile")), "{h} is rendered as a summary");
    }

    worker.signal(Signal::Term)?;
    let exit = worker.wait_exit(WAIT).await?;
    assert_eq!(exit.code(), Some(0), "worker exit status after SIGTERM: {exit:?}");
    Ok(())
}

/// A decode worker closes a KV connection that carried nothing for its idle
/// timeout (30 s by default), while the prefill worker keeps it pooled. The
/// next transfer must not fail on it: the worker sees the close, connects
/// anew, and the KV lands bit for bit. Before the fix that transfer failed
/// (`retryable`: "receiver closed the connection while the sender was
/// busy"), and under `recompute` the decode worker prefilled the prompt
/// itself: in `tandem bench interference` its running streams stalled
/// 250-400 ms per step for seconds after every idle spell over 30 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_the_decode_side_closed_when_idle_is_replaced() -> TestResult {
    let prompt = prompt()?;
    let (layout, fp, want_first, want_kv) = reference(&prompt)?;
    // Each layer gathered into a buffer (the other tcp path): the same bits arrive.
    let worker = one_thread_worker(&["--tcp-pinned", "false"])?;
    let (addr, metrics_addr) = (worker.addr("grpc")?, worker.addr("metrics")?);
    let local = Peer { version_group: VersionGroup::new(GROUP)?, fingerprint: fp };
    let rx = Arc::new(Mutex::new(Receiver::new(local, ReceiverConfig::new(layout))?));
    let pool = Arc::new(Mutex::new(KvPool::new(layout, KV_BLOCKS)?));
    let config = TcpServerConfig { idle_timeout: Duration::from_millis(300), ..TcpServerConfig::default() };
    let server = TcpKvServer::bind("127.0.0.1:0", rx.clone(), pool.clone(), config).await?;
    let mut client = within("gRPC connect", PrefillWorkerClient::connect(format!("http://{addr}"))).await??;

    let n = prompt.len().div_ceil(layout.block_size);
    for round in 1..=2 {
        let blocks = pool.lock().map_err(|_| "pool lock")?.allocate(n)?;
        let r = rx.lock().map_err(|_| "rx lock")?.reserve(
            blocks.clone(),
            Duration::from_secs(120),
            tokio::time::Instant::now(),
        )?;
        let destination = tcp_destination(server.local_addr().to_string(), fp, r, blocks.clone());
        let request = prefill_request(&format!("req-{round}"), &prompt, 0, destination);
        let resp = within("Prefill answer", client.prefill(request)).await??.into_inner();
        let Some(prefill_response::Outcome::FirstToken(first)) = resp.outcome else {
            return Err(format!("round {round}: Prefill did not return a first token: {resp:?}").into());
        };
        assert_eq!(first.id, want_first, "round {round}: first token differs from the single-process engine");
        let ready = rx.lock().map_err(|_| "rx lock")?.take_ready(r)?;
        let got = pool.lock().map_err(|_| "pool lock")?.gather(&ready)?;
        assert!(got == want_kv, "round {round}: received KV differs from the local engine's");
        pool.lock().map_err(|_| "pool lock")?.release(&ready)?;
        if round == 1 {
            // The worker keeps the connection; the decode side closes it once idle.
            let mut stats = server.watch_stats();
            within("the decode side closing the idle connection", stats.wait_for(|s| s.closed_by("idle") == 1))
                .await??;
        }
    }
    let stats = server.stats();
    assert_eq!(stats.connections_accepted, 2, "the worker did not reconnect once: {stats:?}");
    let page = opskit::prom::scrape_within(&metrics_addr, WAIT).await?;
    assert_eq!(page.get(KV_STALE_CONNECTIONS, &[])?, 1.0);
    assert_eq!(page.get(PREFILL_REQUESTS, &[("outcome", "ok")])?, 2.0);
    assert_eq!(page.get(KV_TRANSFER_FAILURES, &[("reason", "io")])?, 0.0);
    assert!(page.get(KV_LAYERS_SENT, &[("path", "gathered")])? >= 2.0 * layout.n_layers as f64);
    assert_eq!(page.get(KV_LAYERS_SENT, &[("path", "pinned")])?, 0.0);
    Ok(())
}

/// A Prefill whose caller goes away while its KV waits to be sent frees that KV, and
/// `/metrics` says so once the worker is polled for health (the dropped handler's release
/// also refreshes the gauges once the runner took it). Before the fix the handler's
/// gauges came only from finished requests, so one taken while the other held its blocks
/// left `tandem_kv_blocks_used` above zero for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_gauge_returns_to_zero_after_a_caller_goes_away_mid_transfer() -> TestResult {
    let prompt = prompt()?;
    let (layout, fp, _, _) = reference(&prompt)?;
    let worker = one_thread_worker(&["--transfer-timeout-ms", "600000"])?;
    let (addr, metrics_addr) = (worker.addr("grpc")?, worker.addr("metrics")?);
    // The transfer waits on a silent destination; the prompt's KV stays held for sending.
    let silent = std::net::TcpListener::bind("127.0.0.1:0")?;
    let n = prompt.len().div_ceil(layout.block_size);
    let request = prefill_request("stuck", &prompt, 0, silent_destination(&silent, fp, n)?);
    let mut client = within("gRPC connect", PrefillWorkerClient::connect(format!("http://{addr}"))).await??;
    let stuck = tokio::spawn({
        let (mut c, r) = (client.clone(), request.clone());
        async move { c.prefill(r).await }
    });
    let used = |mut c: PrefillWorkerClient<tonic::transport::Channel>| async move {
        within("Health answer", c.health(HealthRequest::default()))
            .await
            .map_err(|e| e.to_string())?
            .map(|h| h.into_inner().kv_blocks_used)
            .map_err(|e| e.to_string())
    };
    let held = opskit::poll("the stuck request's KV is held", WAIT, || {
        let c = client.clone();
        async move { used(c).await.map(|n| (n > 0).then_some(n)) }
    })
    .await?;
    // A request that ends (refused) refreshes the gauges while the stuck one holds its blocks.
    let mut wrong = request.clone();
    wrong.request_id = "refused".into();
    if let Some(d) = wrong.destination.as_mut() {
        d.layout_fingerprint = vec![0x5a; 32];
    }
    within("Prefill answer (wrong fingerprint)", client.prefill(wrong)).await??;
    let page = opskit::prom::scrape_within(&metrics_addr, WAIT).await?;
    assert_eq!(page.get(KV_BLOCKS_USED, &[])?, f64::from(held));

    // The caller goes away: its HTTP/2 stream is reset and the handler dropped.
    stuck.abort();
    opskit::poll("the stuck request's KV is freed", WAIT, || {
        let c = client.clone();
        async move { used(c).await.map(|n| (n == 0).then_some(())) }
    })
    .await?;
    let page = opskit::prom::scrape_within(&metrics_addr, WAIT).await?;
    assert_eq!(page.get(KV_BLOCKS_USED, &[])?, 0.0, "freed KV still shows as used");
    drop(silent);
    Ok(())
}

/// One in-test decode side: a receiver and pool behind a TCP KV server, with a
/// reservation of `tokens`' blocks, and the destination naming it.
async fn decode_side(
    layout: KvLayout,
    fp: LayoutFingerprint,
    tokens: usize,
) -> Result<(Arc<Mutex<Receiver>>, TcpKvServer, KvDestination), Box<dyn std::error::Error + Send + Sync>> {
    let local = Peer { version_group: VersionGroup::new(GROUP)?, fingerprint: fp };
    let rx = Arc::new(Mutex::new(Receiver::new(local, ReceiverConfig::new(layout))?));
    let pool = Arc::new(Mutex::new(KvPool::new(layout, KV_BLOCKS)?));
    let blocks = pool.lock().map_err(|_| "pool lock")?.allocate(tokens.div_ceil(layout.block_size))?;
    let r = rx.lock().map_err(|_| "rx lock")?.reserve(
        blocks.clone(),
        Duration::from_secs(120),
        tokio::time::Instant::now(),
    )?;
    let server = TcpKvServer::bind("127.0.0.1:0", rx.clone(), pool, TcpServerConfig::default()).await?;
    let destination = tcp_destination(server.local_addr().to_string(), fp, r, blocks);
    Ok((rx, server, destination))
}

fn frames(rx: &Mutex<Receiver>) -> Result<u64, String> {
    Ok(rx.lock().map_err(|_| "rx lock")?.counters().layer_frames_accepted)
}

/// A prompt whose KV is pushed is answered then, not once the runner next
/// takes a command. A prompt A is sent, and once its first layer's KV
/// arrived (its step runs), a long one B: A runs alone in the first step
/// and B, first come first served in 256-token steps, in the next three.
/// A's answer must come before B's second step ends: fewer than two steps
/// of B's KV frames (one per layer per step) are in. Before the fix the
/// answer waited for the release of A's blocks and then a gauge refresh,
/// two asks the runner takes between steps, so it came after two of B's
/// steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_prompt_is_answered_while_another_prompts_steps_run() -> TestResult {
    let words = prompt()?;
    // A long enough for its step to outlast a poll, short enough to run alone.
    let short: Vec<u32> = words.iter().copied().cycle().take(120).collect();
    let long: Vec<u32> = words.iter().copied().cycle().take(730).collect();
    let (layout, fp, _, _) = reference(&words)?;
    let worker = one_thread_worker(&["--max-batch-tokens", "256"])?;
    let addr = worker.addr("grpc")?;
    // Two decode sides: pushes to one destination share a connection, one at a time.
    let (rx_a, _server_a, dest_a) = decode_side(layout, fp, short.len()).await?;
    let (rx_b, _server_b, dest_b) = decode_side(layout, fp, long.len()).await?;
    let client = within("gRPC connect", PrefillWorkerClient::connect(format!("http://{addr}"))).await??;
    let a = tokio::spawn({
        let (mut c, r, rx_b) = (client.clone(), prefill_request("a", &short, 0, dest_a), rx_b.clone());
        async move {
            let answer = c.prefill(r).await;
            (answer, frames(&rx_b))
        }
    });
    opskit::poll("A's first layer arriving", WAIT, || {
        let n = frames(&rx_a);
        async move { n.map(|n| (n > 0).then_some(())) }
    })
    .await?;
    let b = tokio::spawn({
        let (mut c, r) = (client.clone(), prefill_request("b", &long, 0, dest_b));
        async move { c.prefill(r).await }
    });
    let (a, b_at_a) = within("A's answer", a).await??;
    let (a, b_at_a) = (a?.into_inner(), b_at_a?);
    assert!(matches!(a.outcome, Some(prefill_response::Outcome::FirstToken(_))), "A was not prefilled: {a:?}");
    assert!(frames(&rx_a)? > 0, "A's KV never arrived");
    let b = within("B's answer", b).await???.into_inner();
    assert!(matches!(b.outcome, Some(prefill_response::Outcome::FirstToken(_))), "B was not prefilled: {b:?}");
    let (b_all, layers) = (frames(&rx_b)?, layout.n_layers as u64);
    eprintln!("B's KV frames: {b_at_a} when A was answered, {b_all} in all ({layers} layers)");
    assert!(b_all >= 3 * layers, "B took fewer than three steps ({b_all} frames): the test shows nothing");
    assert!(b_at_a < 2 * layers, "A was answered with {b_at_a} of B's {b_all} KV frames in: two of B's steps later");
    Ok(())
}

/// `PrefillStatus` says where a prompt is: QUEUED until the engine computed a layer of it,
/// RUNNING from then until it is answered, UNKNOWN before and after (and for ids never
/// sent). The worker's KV pool has room for one prompt, and both prompts push to a listener
/// that never answers the handshake, so A holds every block until its caller goes away and B
/// waits in the queue meanwhile (another cache salt: no blocks to share).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_status_follows_a_prompt_from_queued_to_running_to_gone() -> TestResult {
    use proto::worker::v1::{PrefillState, PrefillStatusRequest};
    let prompt = prompt()?;
    let (layout, fp, _, _) = reference(&prompt)?;
    let n = prompt.len().div_ceil(layout.block_size);
    let blocks = n.to_string();
    let kv_blocks = ["--kv-blocks", &blocks, "--transfer-timeout-ms", "600000"];
    let args = ["--grpc", "127.0.0.1:0", "--version-group", GROUP, "--threads", "1"];
    let worker = worker(&[&args[..], &kv_blocks[..]].concat())?;
    let silent = std::net::TcpListener::bind("127.0.0.1:0")?;
    let destination = silent_destination(&silent, fp, n)?;
    let request = |id: &str, salt: u64| prefill_request(id, &prompt, salt, destination.clone());
    let client =
        within("gRPC connect", PrefillWorkerClient::connect(format!("http://{}", worker.addr("grpc")?))).await??;
    let status = |id: &str| {
        let (mut c, ask) = (client.clone(), PrefillStatusRequest { request_id: id.into() });
        async move { c.prefill_status(ask).await.map(|a| a.into_inner().state()).map_err(|e| e.to_string()) }
    };
    let until = |id: &'static str, want: PrefillState| async move {
        let what = format!("{id} {want:?}");
        opskit::poll(&what, WAIT, || {
            let s = status(id);
            async move { s.await.map(|s| (s == want).then_some(())) }
        })
        .await
    };
    assert_eq!(status("a").await?, PrefillState::Unknown, "before it was sent");
    let spawn = |r: PrefillRequest| {
        let mut c = client.clone();
        tokio::spawn(async move { c.prefill(r).await })
    };
    let a = spawn(request("a", 0));
    until("a", PrefillState::Running).await?;
    let b = spawn(request("b", 1));
    opskit::poll("b waiting in the engine's queue", WAIT, || {
        let mut c = client.clone();
        async move {
            let h = c.health(HealthRequest::default()).await.map_err(|e| e.to_string())?.into_inner();
            Ok::<_, String>((h.waiting == 1).then_some(()))
        }
    })
    .await?;
    assert_eq!(status("b").await?, PrefillState::Queued);
    assert_eq!(status("a").await?, PrefillState::Running);
    assert_eq!(status("never-sent").await?, PrefillState::Unknown);
    // A's caller goes away: its blocks are freed and B runs.
    a.abort();
    until("b", PrefillState::Running).await?;
    until("a", PrefillState::Unknown).await?;
    b.abort();
    until("b", PrefillState::Unknown).await?;
    drop(silent);
    Ok(())
}

/// The worker's anonymous resident memory (`RssAnon` of `/proc/PID/status`), in bytes.
fn rss_anon(pid: u32) -> Result<u64, String> {
    Ok(opskit::process::status_kib(pid, "RssAnon").ok_or(format!("no RssAnon for pid {pid}"))? << 10)
}

/// A decode side that takes the handshake and then reads nothing: every push to it
/// stalls once the socket's buffers are full.
async fn stalled_decode_side() -> Result<(String, tokio::task::JoinHandle<()>), std::io::Error> {
    use kvtransfer::{DecodeLimits, Decoded, Frame, HelloAck, PROTOCOL_VERSION};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?.to_string();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((mut s, _)) = l.accept().await {
            let mut buf = Vec::new();
            let hello = loop {
                if let Ok(Decoded::Frame { frame, .. }) = Frame::decode(&buf, &DecodeLimits::default()) {
                    break Some(frame);
                }
                let mut chunk = [0u8; 256];
                match s.read(&mut chunk).await {
                    Ok(n) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                    _ => break None,
                }
            };
            if let Some(Frame::Hello(_)) = hello {
                let mut wire = Vec::new();
                let ack = Frame::HelloAck(HelloAck { protocol_version: PROTOCOL_VERSION });
                if ack.encode(&mut wire).is_ok() && s.write_all(&wire).await.is_ok() {
                    held.push(s); // never read again
                }
            }
        }
    });
    Ok((addr, task))
}

/// Sent straight from the pool (`--tcp-pinned`, the default), a one-step prompt whose
/// push stalls costs the worker no copy of its KV: the layers wait as checksums and block
/// ids while the blocks stay where the engine wrote them. Gathered, each layer the socket
/// has no room for waits as a copy in the worker's heap (here most of the prompt's 11 MiB).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_push_holds_no_copy_of_the_kv_when_sent_from_the_pool() -> TestResult {
    let path = engine::paths::default_model_path();
    let (w, f) = Weights::from_gguf(&path)?;
    let tok = Tokenizer::from_gguf(&f)?;
    let layout = Model::new(w, 1)?.kv_layout(16, KvDtype::F16);
    let fp = LayoutFingerprint::new(&layout, &engine::weights::digest::weights_digest(&path)?, &tok.digest());
    // One step of the engine's 512 tokens: every layer of it is sent from the pool.
    let long = long_prompt(500)?;
    let n = long.len().div_ceil(layout.block_size);
    let kv_bytes = (n * layout.n_layers * 2 * layout.side_bytes()) as u64;
    let mut growth = Vec::new();
    for pinned in ["true", "false"] {
        let (addr, decode) = stalled_decode_side().await?;
        let worker = one_thread_worker(&["--tcp-pinned", pinned, "--transfer-timeout-ms", "120000"])?;
        let client =
            within("gRPC connect", PrefillWorkerClient::connect(format!("http://{}", worker.addr("grpc")?))).await??;
        let before = rss_anon(worker.pid)?;
        let r = Reservation { id: ReservationId(7), generation: 1 };
        let destination = tcp_destination(addr, fp, r, (0..n as u32).collect());
        let request = prefill_request("stalled", &long, 0, destination);
        let mut c = client.clone();
        let push = tokio::spawn(async move { c.prefill(request).await });
        // Computed and held for sending: nothing runs or waits, the prompt's blocks are in use.
        opskit::poll("the prompt computed, its push stalled", WAIT, || {
            let mut c = client.clone();
            async move {
                let h = c.health(HealthRequest::default()).await.map_err(|e| e.to_string())?.into_inner();
                Ok::<_, String>((h.running == 0 && h.waiting == 0 && h.kv_blocks_used as usize >= n).then_some(()))
            }
        })
        .await?;
        let grew = rss_anon(worker.pid)?.saturating_sub(before);
        eprintln!(
            "tcp_pinned {pinned}: RssAnon grew {} KiB with the push stalled ({} KiB of KV)",
            grew >> 10,
            kv_bytes >> 10
        );
        growth.push(grew);
        push.abort();
        decode.abort();
        drop(worker);
    }
    let (pinned, gathered) = (growth[0], growth[1]);
    assert!(gathered > kv_bytes / 3, "gathered: {gathered} bytes more for {kv_bytes} bytes of KV (the copies)");
    assert!(pinned < gathered / 4, "sent from the pool: {pinned} bytes more, gathered {gathered}");
    Ok(())
}
