//! The generated service and client talk over a real socket: a tonic server on
//! 127.0.0.1:0 with a trivial in-test DecodeWorker, and a tonic client.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

use std::error::Error;
use std::future::Future;
use std::time::Duration;

use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
use proto::worker::v1::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use proto::worker::v1::{
    generate_response, AbortRequest, AbortResponse, FinishReason, Finished, GenerateRequest, GenerateResponse,
    HealthRequest, HealthResponse, PrefixReport, PrefixUpdate, TokenChunk, TopLogprob, WatchPrefixesRequest,
    WatchedLoad,
};
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status};

type TestResult = Result<(), Box<dyn Error + Send + Sync>>;

/// Bound on every wait; the work is loopback-only, so hitting it means a hang.
const WAIT: Duration = Duration::from_secs(10);

const FINGERPRINT: [u8; 32] = [0xab; 32];

/// Echoes the prompt back: one TokenChunk per prompt token (3 in the test),
/// then Finished.
struct EchoDecoder;

#[tonic::async_trait]
impl DecodeWorker for EchoDecoder {
    type GenerateStream = tokio_stream::Iter<std::vec::IntoIter<Result<GenerateResponse, Status>>>;

    async fn generate(&self, request: Request<GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let req = request.into_inner();
        let mut events: Vec<Result<GenerateResponse, Status>> = req
            .token_ids
            .iter()
            .map(|&id| {
                let token =
                    TokenChunk { id, logprob: Some(-0.5), top: vec![TopLogprob { id, logprob: -0.5 }], index: None };
                Ok(GenerateResponse {
                    event: Some(generate_response::Event::Token(token)),
                    prefill_attempts: Vec::new(),
                })
            })
            .collect();
        let finished = Finished {
            reason: FinishReason::Length as i32,
            prompt_tokens: req.token_ids.len() as u32,
            generated_tokens: req.token_ids.len() as u32,
            prefilled_remotely: !req.prefill.is_empty(),
            cached_prompt_tokens: 0,
            seed: 0,
        };
        events.push(Ok(GenerateResponse {
            event: Some(generate_response::Event::Finished(finished)),
            prefill_attempts: Vec::new(),
        }));
        Ok(Response::new(tokio_stream::iter(events)))
    }

    async fn abort(&self, _request: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        Ok(Response::new(AbortResponse { found: false }))
    }

    async fn health(&self, _request: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        Ok(Response::new(HealthResponse {
            live: true,
            ready: true,
            version_group: "smollm2-135m-q4_1/v1".into(),
            layout_fingerprint: FINGERPRINT.to_vec(),
            kv_blocks_total: 1024,
            kv_blocks_used: 17,
            running: 2,
            waiting: 1,
            preemptions: 3,
            prefix_epoch: 5,
            prefix: Some(PrefixReport { block_size: 16, hashes: vec![1, u64::MAX] }),
            determinism_fingerprint: Vec::new(),
        }))
    }

    type WatchPrefixesStream = tokio_stream::Iter<std::vec::IntoIter<Result<PrefixUpdate, Status>>>;

    /// The whole set with the load, then one change.
    async fn watch_prefixes(
        &self,
        _: Request<WatchPrefixesRequest>,
    ) -> Result<Response<Self::WatchPrefixesStream>, Status> {
        let load = WatchedLoad { running: 3, waiting: 1, kv_blocks_used: 20, kv_blocks_total: u32::MAX };
        let snapshot = PrefixUpdate {
            seq: 1,
            block_size: 16,
            snapshot: true,
            added: vec![1, u64::MAX],
            removed: vec![],
            load: Some(load),
        };
        let change =
            PrefixUpdate { seq: 2, block_size: 16, snapshot: false, added: vec![2], removed: vec![1], load: None };
        Ok(Response::new(tokio_stream::iter(vec![Ok(snapshot), Ok(change)])))
    }
}

async fn within<T>(what: &str, fut: impl Future<Output = T>) -> Result<T, String> {
    tokio::time::timeout(WAIT, fut).await.map_err(|_| format!("{what} did not happen within {WAIT:?}"))
}

#[tokio::test]
async fn decode_worker_streams_tokens_and_reports_health_over_tcp() -> TestResult {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DecodeWorkerServer::new(EchoDecoder))
            .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
                // A dropped sender also stops the server, so a failing test never leaks it.
                let _ = stop_rx.await;
            }),
    );

    let mut client = within("client connect", DecodeWorkerClient::connect(format!("http://{addr}"))).await??;

    let request = GenerateRequest { request_id: "req-1".into(), token_ids: vec![11, 22, 33], ..Default::default() };
    let mut stream = within("Generate call", client.generate(request)).await??.into_inner();
    let mut events = Vec::new();
    while let Some(msg) = within("next Generate event", stream.message()).await?? {
        events.push(msg.event.ok_or("GenerateResponse without an event")?);
    }
    use generate_response::Event;
    let tokens: Vec<u32> = events
        .iter()
        .filter_map(|e| match e {
            Event::Token(t) => Some(t.id),
            _ => None,
        })
        .collect();
    assert_eq!(tokens, [11, 22, 33]);
    assert_eq!(events.len(), 4, "3 tokens then exactly one Finished: {events:?}");
    let Some(Event::Finished(finished)) = events.last() else {
        return Err(format!("last event is not Finished: {events:?}").into());
    };
    assert_eq!(finished.reason(), FinishReason::Length);
    assert_eq!((finished.prompt_tokens, finished.generated_tokens, finished.prefilled_remotely), (3, 3, false));
    let Event::Token(first) = &events[0] else {
        return Err("first event is not a token".into());
    };
    assert_eq!(first.logprob, Some(-0.5));
    assert_eq!(first.top, [TopLogprob { id: 11, logprob: -0.5 }]);

    let health = within("Health call", client.health(HealthRequest::default())).await??.into_inner();
    assert_eq!(
        health,
        HealthResponse {
            live: true,
            ready: true,
            version_group: "smollm2-135m-q4_1/v1".into(),
            layout_fingerprint: FINGERPRINT.to_vec(),
            kv_blocks_total: 1024,
            kv_blocks_used: 17,
            running: 2,
            waiting: 1,
            preemptions: 3,
            prefix_epoch: 5,
            prefix: Some(PrefixReport { block_size: 16, hashes: vec![1, u64::MAX] }),
            determinism_fingerprint: Vec::new(),
        }
    );

    // A server stream of prefix updates crosses intact, in order, 64-bit hashes whole.
    let mut watch = within("WatchPrefixes call", client.watch_prefixes(WatchPrefixesRequest {})).await??.into_inner();
    let mut got = Vec::new();
    while let Some(u) = within("a prefix update", watch.message()).await?? {
        got.push((u.seq, u.snapshot, u.added, u.removed, u.load.map(|l| (l.running, l.waiting, l.kv_blocks_total))));
    }
    assert_eq!(
        got,
        [(1, true, vec![1, u64::MAX], vec![], Some((3, 1, u32::MAX))), (2, false, vec![2], vec![1], None)],
        "the load only where it was set"
    );

    // Close the client's connection so graceful shutdown has nothing to drain.
    drop(client);
    stop_tx.send(()).map_err(|()| "server exited before shutdown was requested")?;
    // Timeout, then the task (panic), then the server's own result.
    within("server shutdown", server).await???;
    Ok(())
}
