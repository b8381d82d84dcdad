//! `tandem-decode-worker`: loads the model, listens for KV transfers (tcp, quic, local or ucx),
//! serves `DecodeWorker` on gRPC and Prometheus `/metrics` on HTTP, prints
//! `listening metrics=ADDR`, `listening transfer=ADDR` and then
//! `listening grpc=ADDR` once all are bound. On SIGTERM/SIGINT it stops
//! admitting, lets requests waiting for remote KV join the batch, drains
//! the engine for `shutdown_timeout` (failing what cannot finish with a
//! typed error), and exits 0.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use decode_worker::service::{DecodeService, DecodeSettings};
use decode_worker::sink::RunnerSink;
use decode_worker::{DecodeConfig, DecodeFlags};
use engine::runner::{Runner, RunnerConfig, RunnerHandle};
use kvtransfer::{
    KvServer, LocalServerConfig, Peer, PeerTrust, QuicServerConfig, Receiver, ReceiverConfig, ServerConfig,
    TcpServerConfig, TlsIdentity, TransportKind, UcxServerConfig,
};
use proto::worker::v1::decode_worker_server::DecodeWorkerServer;
use tokio_util::sync::CancellationToken;

fn main() -> anyhow::Result<()> {
    worker_common::serve::main(|| DecodeConfig::load(&DecodeFlags::parse()), |c| &c.common, run)
}

async fn run(cfg: DecodeConfig) -> anyhow::Result<()> {
    // Before anything announces this worker: a SIGTERM from then on drains it.
    let mut signals = registry::StopSignals::install()?;
    let common = &cfg.common;
    tracing::info!(
        policy = %cfg.policy, max_absorbed_prefill_tokens_per_s = cfg.max_absorbed_prefill_tokens_per_s,
        "kv_load_failure_policy"
    );
    let loaded = worker_common::serve::load(common)?;
    let (layout, fingerprint) = (loaded.layout, loaded.fingerprint);
    let (runner, join) = Runner::spawn(loaded.engine, RunnerConfig { max_waiting: common.max_waiting })?;

    let metrics_addr = worker_common::metrics::install(common.metrics, decode_worker::metrics::BUCKETS)
        .with_context(|| format!("serving metrics on {}", common.metrics))?;
    decode_worker::metrics::describe(cfg.policy);
    println!("listening metrics={metrics_addr}");

    let local = Peer { version_group: common.version_group.clone(), fingerprint };
    let mut rx_config = ReceiverConfig::new(layout);
    // The pool bounds what can be reserved; the lease cap covers the configured TTL.
    rx_config.max_blocks_per_reservation = common.kv_blocks;
    rx_config.max_lease = rx_config.max_lease.max(cfg.reservation_ttl);
    let receiver = Arc::new(Mutex::new(Receiver::new(local.clone(), rx_config)?));
    let sink = RunnerSink::new(runner.clone(), &receiver);
    let (kv_server, tls_cert_sha256) = bind_transfer(&cfg, receiver.clone(), sink, &runner).await?;
    let advertised = cfg.advertise_transfer.clone().unwrap_or_else(|| kv_server.local_addr());
    println!("listening transfer={}", kv_server.local_addr());
    export_stats(&kv_server);
    decode_worker::metrics::record_transport(cfg.transport);
    tracing::info!(transport = %cfg.transport, addr = %advertised, "KV transfer listener");

    let settings = DecodeSettings {
        policy: cfg.policy,
        reservation_ttl: cfg.reservation_ttl,
        max_prefill_attempts: cfg.max_prefill_attempts,
        max_pending_remote: common.max_waiting.max(1),
        transfer_addr: advertised.clone(),
        transport: cfg.transport,
        tls_cert_sha256,
        max_absorbed_prefill_tokens_per_s: cfg.max_absorbed_prefill_tokens_per_s,
    };
    let service = DecodeService::new(runner.clone(), local, receiver, settings);
    let reaper_stop = CancellationToken::new();
    let reaper = tokio::spawn(service.clone().reap_forever(reaper_stop.clone()));

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
            .add_service(DecodeWorkerServer::new(service.clone())),
        listener,
    );
    let mut info =
        worker_common::serve::worker_info(common, registry::Role::Decode, &fingerprint, listener_addr, metrics_addr);
    if let Some(a) = &cfg.advertise_grpc {
        // Coordinators call this address (a proxy in the control-link drills).
        tracing::info!(addr = %a, bound = %listener_addr, "advertised gRPC address");
        info.grpc_addr = a.clone();
    }
    info.transfer = Some(registry::TransferEndpoint {
        addr: advertised.clone(),
        transport: cfg.transport.as_str().to_owned(),
        cert_sha256: tls_cert_sha256.map(|f| worker_common::serve::hex(&f)),
    });
    let registration = worker_common::serve::register(common, info, fencing).await?;
    let signal = signals.recv().await;
    tracing::info!(signal, "draining");
    probe.draining();
    worker_common::serve::announce_draining(registration.as_ref()).await;
    // Phase 1: stop admitting; requests waiting for remote KV join the batch.
    let left = service.drain(common.shutdown_timeout).await;
    stop.cancel();
    // Phase 2: the engine finishes what it can within the grace, fails the rest.
    // Off the async threads: queueing it may wait for room (engine/src/runner).
    let r = runner.clone();
    if let Err(e) = worker_common::serve::blocking(move || r.shutdown(left)).await {
        tracing::warn!(error = %e.message, "could not tell the runner to drain");
    }
    // Streams end once the engine has answered every request.
    if tokio::time::timeout(left + Duration::from_secs(1), server).await.is_err() {
        tracing::warn!("in-flight streams did not end within the grace");
    }
    reaper_stop.cancel();
    let _ = reaper.await;
    kv_server.shutdown();
    worker_common::serve::finish(join, left + Duration::from_secs(1), registration).await;
    Ok(())
}

/// Exports the KV listener's counters to `/metrics` as they change (a task that
/// ends when the listener stops).
fn export_stats(server: &KvServer) {
    let (mut rx, kind) = (server.watch_stats(), server.kind());
    tokio::spawn(async move {
        loop {
            {
                let stats = rx.borrow_and_update();
                decode_worker::metrics::record_connections(&stats, kind);
                if kind == TransportKind::Ucx {
                    decode_worker::metrics::record_ucx(&stats.ucx);
                }
            }
            if rx.changed().await.is_err() {
                break;
            }
        }
    });
}

/// Binds the KV listener; for QUIC with no configured certificate, makes a
/// self-signed one and returns its fingerprint for destinations to carry.
async fn bind_transfer(
    cfg: &DecodeConfig,
    receiver: Arc<Mutex<Receiver>>,
    sink: RunnerSink,
    runner: &RunnerHandle,
) -> anyhow::Result<(KvServer, Option<[u8; 32]>)> {
    let addr = cfg.transfer.as_str();
    let bound = |e: std::io::Error| anyhow::anyhow!("binding transfer {addr}: {e}");
    match cfg.transport {
        TransportKind::Local => {
            let config = LocalServerConfig { idle_timeout: cfg.transfer_idle_timeout, ..LocalServerConfig::default() };
            let s = KvServer::bind(addr, receiver, sink, ServerConfig::Local(config)).await.map_err(bound)?;
            Ok((s, None))
        }
        TransportKind::Tcp => {
            let direct = if cfg.tcp_direct {
                Some(
                    worker_common::serve::pool_memory(runner, "tcp_direct: the TCP server reads payloads into it")
                        .await?,
                )
            } else {
                None
            };
            let config =
                TcpServerConfig { idle_timeout: cfg.transfer_idle_timeout, direct, ..TcpServerConfig::default() };
            let s = KvServer::bind(addr, receiver, sink, ServerConfig::Tcp(config)).await.map_err(bound)?;
            Ok((s, None))
        }
        TransportKind::Ucx => {
            let pool_blocks = if cfg.ucx_direct {
                let r = runner.clone();
                Some(tokio::task::spawn_blocking(move || r.with_pool(|p| p.num_blocks())).await??)
            } else {
                None
            };
            let config =
                UcxServerConfig { landing_bytes: cfg.ucx_landing_bytes, pool_blocks, ..UcxServerConfig::default() };
            let mut server = KvServer::bind(addr, receiver, sink, ServerConfig::Ucx(config))
                .await
                .context("starting the UCX KV server")?;
            let s = server.ucx_mut().context("a ucx server")?;
            tracing::info!(ucx_tls = %kvtransfer::transport::ucx::ucx_tls(), landing_bytes = cfg.ucx_landing_bytes, "UCX landing region registered");
            if let Some(memory) = s.pool_memory() {
                // The pool moves into the registered memory before any request can use it
                // (nothing is announced yet); only then may senders write it directly.
                let (r, bytes) = (runner.clone(), memory.len());
                let shared = memory.into_shared();
                tokio::task::spawn_blocking(move || r.with_pool(move |p| p.adopt(shared)))
                    .await??
                    .context("moving the KV pool into UCX memory (ucx_direct)")?;
                s.enable_direct();
                tracing::info!(bytes, "KV pool in UCX-registered memory: senders on this host write it directly");
            }
            Ok((server, None))
        }
        TransportKind::Quic => {
            let files = &cfg.common.quic;
            let (identity, pin) = match files.load_identity().context("loading quic_cert/quic_key")? {
                Some(id) => (id, None),
                None => {
                    let id = TlsIdentity::self_signed(&["tandem-kv"]).context("making a self-signed certificate")?;
                    let fp = id.fingerprint();
                    tracing::warn!(fingerprint = %fp, "QUIC with a self-signed certificate (development): prefill workers pin it");
                    (id, Some(fp.0))
                }
            };
            let mut config = QuicServerConfig::new(identity);
            config.client_trust = files.load_ca().context("loading quic_ca")?.map(|ca: PeerTrust| ca);
            config.idle_timeout = cfg.transfer_idle_timeout;
            let s = KvServer::bind(addr, receiver, sink, ServerConfig::Quic(config)).await;
            Ok((s.context("binding the QUIC listener")?, pin))
        }
    }
}
