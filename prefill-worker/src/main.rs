//! `tandem-prefill-worker`: loads the model, serves `PrefillWorker` on gRPC
//! and Prometheus `/metrics` on HTTP, prints `listening metrics=ADDR` and then
//! `listening grpc=ADDR` once both are bound, and on SIGTERM/SIGINT stops
//! accepting, drains the runner for `shutdown_timeout`, and exits 0.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use engine::runner::{Runner, RunnerConfig};
use kvtransfer::Peer;
use prefill_worker::service::{PrefillService, TransferSettings};
use prefill_worker::{PrefillConfig, PrefillFlags};
use proto::worker::v1::prefill_worker_server::PrefillWorkerServer;
use tokio_util::sync::CancellationToken;

fn main() -> anyhow::Result<()> {
    worker_common::serve::main(|| PrefillConfig::load(&PrefillFlags::parse()), |c| &c.common, run)
}

async fn run(cfg: PrefillConfig) -> anyhow::Result<()> {
    // Before anything announces this worker: a SIGTERM from then on drains it.
    let mut signals = registry::StopSignals::install()?;
    let common = &cfg.common;
    #[cfg(feature = "fault-injection")]
    if cfg.fault_kv_corrupt > 0 {
        tracing::warn!(
            transfers = cfg.fault_kv_corrupt,
            "FAULT INJECTION ON (fault_kv_corrupt): the next KV transfers get one byte flipped after their \
             checksum; drills only"
        );
        kvtransfer::transport::fault::arm_corrupt(
            cfg.fault_kv_corrupt,
            prefill_worker::metrics::record_kv_corrupt_fault,
        );
    }
    #[cfg(feature = "fault-injection")]
    if cfg.fault_swap_token > 0 || cfg.fault_leak_blocks > 0 {
        tracing::warn!(
            swap_token = cfg.fault_swap_token,
            leak_blocks = cfg.fault_leak_blocks,
            "FAULT INJECTION ON (planted bugs): those prefills answer a wrong first token or leak their KV \
             blocks; drills only"
        );
        prefill_worker::plant::arm(cfg.fault_swap_token, cfg.fault_leak_blocks);
    }
    let loaded = worker_common::serve::load(common)?;
    let (layout, fingerprint) = (loaded.layout, loaded.fingerprint);
    let (runner, join) = Runner::spawn(loaded.engine, RunnerConfig { max_waiting: common.max_waiting })?;

    let process = CancellationToken::new();
    let local = Peer { version_group: common.version_group.clone(), fingerprint };
    let pinned = if cfg.tcp_pinned {
        Some(worker_common::serve::pool_memory(&runner, "tcp_pinned: TCP frames are written from it").await?)
    } else {
        None
    };
    let transfer = TransferSettings {
        timeout: cfg.transfer_timeout,
        pinned,
        quic_ca: common.quic.load_ca().context("loading quic_ca")?,
        quic_identity: common.quic.load_identity().context("loading quic_cert/quic_key")?,
    };
    let service = PrefillService::new(runner.clone(), layout, local, transfer, process.clone());

    let metrics_addr = worker_common::metrics::install(common.metrics, prefill_worker::metrics::BUCKETS)
        .with_context(|| format!("serving metrics on {}", common.metrics))?;
    prefill_worker::metrics::describe();
    println!("listening metrics={metrics_addr}");

    let listener = worker_common::serve::bind_grpc(common, &fingerprint).await?;
    let listener_addr = listener.local_addr()?;
    let (probe, probe_service) = worker_common::serve::Probe::start();
    let (fenced, probe_fenced) = (service.clone(), probe.clone());
    let fencing = worker_common::serve::Fencing::start(common.coordinator_silence_fence, move |f| {
        fenced.set_fenced(f);
        probe_fenced.fenced(f);
    });
    let (server, stop) = worker_common::serve::spawn_grpc(
        tonic::transport::Server::builder()
            .layer(fencing.layer())
            .add_service(probe_service)
            .add_service(PrefillWorkerServer::new(service.clone())),
        listener,
    );
    let info =
        worker_common::serve::worker_info(common, registry::Role::Prefill, &fingerprint, listener_addr, metrics_addr);
    let registration = worker_common::serve::register(common, info, fencing).await?;
    let signal = signals.recv().await;
    tracing::info!(signal, "draining");
    probe.draining();
    worker_common::serve::announce_draining(registration.as_ref()).await;
    // Phase 1: stop admitting. Phase 2: drain for the grace. Phase 3: cancel the rest.
    service.set_draining();
    stop.cancel();
    // Off the async threads: queueing it may wait for room (engine/src/runner).
    let (r, grace) = (runner.clone(), common.shutdown_timeout);
    if let Err(e) = worker_common::serve::blocking(move || r.shutdown(grace)).await {
        tracing::warn!(error = %e.message, "could not tell the runner to drain");
    }
    let grace = common.shutdown_timeout + cfg.transfer_timeout;
    if tokio::time::timeout(grace, server).await.is_err() {
        tracing::warn!(?grace, "in-flight RPCs did not finish within the grace; cancelling them");
    }
    process.cancel();
    worker_common::serve::finish(join, grace + Duration::from_secs(1), registration).await;
    Ok(())
}
