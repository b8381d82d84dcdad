//! The decode worker's Generate and Health RPCs as the process tests call
//! them: one request's walk to its end, with every wait bounded; and a
//! prefill worker held busy by a Prefill of the tests' own.
//!
//! Included by path (`#[path = "common/rpc.rs"] mod rpc;`) beside `mod common;`.
#![allow(dead_code)] // each test binary uses its own part of this module

use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
use proto::worker::v1::{
    generate_response, ErrorKind, Finished, GenerateRequest, HealthRequest, KvLoadFailurePolicy, PrefillTarget,
    WorkerError,
};
use tonic::transport::Channel;

use crate::common::{self, wait_metric, within, TestResult, Worker, WAIT};
use facts::metrics::decode::RESERVATIONS_ACTIVE;

pub const GROUP: &str = "g1";
pub const MAX_TOKENS: u32 = 6;

/// What a Generate stream delivered.
#[derive(Debug)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    /// Each token's index as the worker numbered it.
    pub indices: Vec<Option<u32>>,
    pub end: Result<Finished, WorkerError>,
    /// The remote prefill attempts reported on the stream: (worker_id, failure reason or "ok").
    pub attempts: Vec<(String, String)>,
}

pub async fn client(w: &Worker) -> Result<DecodeWorkerClient<Channel>, String> {
    let addr = w.addr("grpc").map_err(|e| e.to_string())?;
    within("gRPC connect", DecodeWorkerClient::connect(format!("http://{addr}")))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("connect to the decode worker {addr}: {e}"))
}

pub fn target(w: &Worker) -> Result<PrefillTarget, String> {
    Ok(PrefillTarget { worker_id: format!("pid-{}", w.pid), grpc_addr: w.addr("grpc").map_err(|e| e.to_string())? })
}

pub fn request(id: &str, prompt: &[u32], prefill: Vec<PrefillTarget>) -> GenerateRequest {
    GenerateRequest {
        request_id: id.into(),
        token_ids: prompt.to_vec(),
        sampling: Some((&common::greedy(MAX_TOKENS)).into()),
        deadline_unix_ms: 0,
        prefill,
        policy_override: None,
        cache_salt: 0,
        priority: 0,
        generated_ids: Vec::new(),
        determinism_fingerprint: Vec::new(),
    }
}

pub fn with_policy(mut r: GenerateRequest, p: KvLoadFailurePolicy) -> GenerateRequest {
    r.policy_override = Some(p as i32);
    r
}

pub async fn generate(c: &mut DecodeWorkerClient<Channel>, req: GenerateRequest) -> Result<Outcome, String> {
    let id = req.request_id.clone();
    let collect = async {
        let mut stream = c.generate(req).await.map_err(|s| format!("Generate {id}: {s}"))?.into_inner();
        let mut tokens = Vec::new();
        let mut indices = Vec::new();
        let mut attempts = Vec::new();
        while let Some(msg) = stream.message().await.map_err(|s| format!("Generate {id} stream: {s}"))? {
            for a in &msg.prefill_attempts {
                let who = a.target.as_ref().map(|t| t.worker_id.clone()).unwrap_or_default();
                let how = if a.error.is_none() { "ok".to_owned() } else { a.reason.clone() };
                attempts.push((who, how));
            }
            match msg.event {
                Some(generate_response::Event::Token(t)) => {
                    tokens.push(t.id);
                    indices.push(t.index);
                }
                Some(generate_response::Event::Finished(f)) => {
                    return Ok(Outcome { tokens, indices, end: Ok(f), attempts })
                }
                Some(generate_response::Event::Error(e)) => {
                    return Ok(Outcome { tokens, indices, end: Err(e), attempts })
                }
                None => return Err(format!("Generate {id}: an empty event")),
            }
        }
        Err(format!("Generate {id}: the stream ended without Finished or an error"))
    };
    within(&format!("Generate {id} to end"), collect).await.map_err(|e| e.to_string())?
}

/// The decode worker's used KV blocks and live reservations, once settled.
pub async fn assert_no_kv_left(name: &str, w: &Worker) -> TestResult {
    assert_kv_used(name, w, 0).await
}

/// Waits until `w` has no live reservation, then checks that exactly `used` pool blocks
/// are in use (0, or those quarantined for a stopped sender).
pub async fn assert_kv_used(name: &str, w: &Worker, used: u32) -> TestResult {
    let metrics = w.addr("metrics")?;
    wait_metric(&metrics, RESERVATIONS_ACTIVE, &[], |v| v == 0.0).await?;
    // Blocks of ended reservations go back on the reaper's next pass (at most 500 ms):
    // asked until the pool says so, failing with what it last said.
    let c = client(w).await?;
    let what = format!("{name}: {used} KV blocks in use");
    opskit::poll(&what, WAIT, || {
        let mut c = c.clone();
        async move {
            let h = c.health(HealthRequest::default()).await.map_err(|e| e.to_string())?.into_inner();
            if h.kv_blocks_used == used {
                Ok(Some(()))
            } else {
                Err(format!("{} in use: {h:?}", h.kv_blocks_used))
            }
        }
    })
    .await?;
    Ok(())
}

pub fn kind(o: &Outcome) -> Option<ErrorKind> {
    o.end.as_ref().err().map(|e| e.kind())
}

/// A Prefill sent straight to `prefill` (as a decode worker would) whose KV goes to a listener
/// that never answers the handshake: once its first layer is computed it holds its blocks on
/// the prefill worker until the returned call is dropped. With `--kv-blocks` at its block
/// count, every later prompt waits in that worker's queue meanwhile.
pub async fn hold_prefill_worker(
    prefill: &Worker,
    id: &str,
    prompt: &[u32],
    silent: &std::net::TcpListener,
) -> Result<
    tokio::task::JoinHandle<Result<tonic::Response<proto::worker::v1::PrefillResponse>, tonic::Status>>,
    Box<dyn std::error::Error + Send + Sync>,
> {
    use proto::worker::v1::prefill_worker_client::PrefillWorkerClient;
    use proto::worker::v1::{KvDestination, PrefillRequest, PrefillState, PrefillStatusRequest};
    let mut pc =
        within("gRPC connect", PrefillWorkerClient::connect(format!("http://{}", prefill.addr("grpc")?))).await??;
    let health = within("Health", pc.health(HealthRequest::default())).await??.into_inner();
    let call = PrefillRequest {
        request_id: id.into(),
        token_ids: prompt.to_vec(),
        sampling: Some((&common::greedy(1)).into()),
        deadline_unix_ms: 0,
        cache_salt: 0,
        priority: 0,
        destination: Some(KvDestination {
            transfer_addr: silent.local_addr()?.to_string(),
            transport: "tcp".into(),
            reservation_id: 1,
            generation: 1,
            block_ids: (0..prompt.len().div_ceil(16) as u32).collect(),
            layout_fingerprint: health.layout_fingerprint,
            version_group: GROUP.into(),
            tls_cert_sha256: vec![],
        }),
        generated_ids: Vec::new(),
        determinism_fingerprint: Vec::new(),
    };
    let held = tokio::spawn({
        let mut pc = pc.clone();
        async move { pc.prefill(call).await }
    });
    opskit::poll("the holder's first layer computed", WAIT, || {
        let (mut pc, id) = (pc.clone(), id.to_owned());
        async move {
            let ask = PrefillStatusRequest { request_id: id };
            let state = pc.prefill_status(ask).await.map_err(|e| e.to_string())?.into_inner().state();
            Ok::<_, String>((state == PrefillState::Running).then_some(()))
        }
    })
    .await?;
    Ok(held)
}
