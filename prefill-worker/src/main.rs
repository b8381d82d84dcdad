//! `tandem-prefill-worker`: loads the model, serves `PrefillWorker` on gRPC
//! and Prometheus `/metrics` on HTTP, prints `listening metrics=ADDR` and then
//! `listening grpc=ADDR` once both are bound, and on SIGTERM/SIGINT stops
//! accepting, drains the runner for `shutdown_timeout`, and exits 0.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use engine::batch::{Engine, EngineConfig};
use engine::model::Model;
use engine::runner::{Runner, RunnerConfig};
use engine::tokenizer::Tokenizer;
use engine::weights::digest::weights_digest;
use engine::weights::Weights;
use kvtransfer::{LayoutFingerprint, Peer, TcpSenderConfig};
use prefill_worker::config::{Config, Flags};
use prefill_worker::service::PrefillService;
use proto::worker::v1::prefill_worker_server::PrefillWorkerServer;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let cfg = Config::load(&Flags::parse())?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(run(cfg))
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let (weights, gguf) = Weights::from_gguf(&cfg.model).with_context(|| format!("loading {}", cfg.model.display()))?;
    let tokenizer = Tokenizer::from_gguf(&gguf).context("loading the tokenizer")?;
    let model = Model::new(weights, cfg.threads).context("building the model")?;
    let layout = model.kv_layout(cfg.kv_block_size, cfg.kv_dtype);
    let digest = weights_digest(&cfg.model).with_context(|| format!("hashing {}", cfg.model.display()))?;
    let fingerprint = LayoutFingerprint::new(&layout, &digest, &tokenizer.digest());
    let engine_cfg = EngineConfig {
        block_size: cfg.kv_block_size,
        kv_dtype: cfg.kv_dtype,
        kv_blocks: cfg.kv_blocks,
        max_batch_tokens: cfg.max_batch_tokens,
        max_running: cfg.max_running,
        prefix_cache: true,
    };
    let engine = Engine::new(model, engine_cfg, tokenizer.eos_ids().to_vec()).context("building the engine")?;
    let (runner, join) = Runner::spawn(engine, RunnerConfig { max_waiting: cfg.max_waiting })?;

    let process = CancellationToken::new();
    let local = Peer { version_group: cfg.version_group.clone(), fingerprint };
    let sender_config = TcpSenderConfig { timeout: cfg.transfer_timeout, ..TcpSenderConfig::default() };
    let service = PrefillService::new(runner.clone(), layout, local, sender_config, process.clone());

    let metrics_addr =
        prefill_worker::metrics::install(cfg.metrics).with_context(|| format!("serving metrics on {}", cfg.metrics))?;
    println!("listening metrics={metrics_addr}");

    let listener =
        tokio::net::TcpListener::bind(cfg.grpc).await.with_context(|| format!("binding grpc {}", cfg.grpc))?;
    let addr = listener.local_addr()?;
    println!("listening grpc={addr}");
    tracing::info!(%addr, fingerprint = %fingerprint, group = cfg.version_group.as_str(), "ready");

    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let stop = CancellationToken::new();
    let stopping = stop.clone();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(PrefillWorkerServer::new(service.clone()))
            .serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(listener),
                stopping.cancelled_owned(),
            ),
    );
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: draining"),
        _ = int.recv() => tracing::info!("SIGINT: draining"),
    }
    // Phase 1: stop admitting. Phase 2: drain for the grace. Phase 3: cancel the rest.
    service.set_draining();
    stop.cancel();
    runner.shutdown(cfg.shutdown_timeout);
    let grace = cfg.shutdown_timeout + cfg.transfer_timeout;
    if tokio::time::timeout(grace, server).await.is_err() {
        tracing::warn!(?grace, "in-flight RPCs did not finish within the grace; cancelling them");
    }
    process.cancel();
    let joined = tokio::task::spawn_blocking(move || join.join());
    match tokio::time::timeout(grace + Duration::from_secs(1), joined).await {
        Ok(Ok(Ok(_engine))) => tracing::info!("runner drained"),
        _ => tracing::warn!("runner thread did not exit cleanly"),
    }
    Ok(())
}
