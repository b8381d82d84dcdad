//! One worker as the poller reaches it: its gRPC client (`Health`, `WatchPrefixes`)
//! and the task that keeps its watch stream open and applies it to the board.

use std::sync::Weak;
use std::time::Duration;

use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
use proto::worker::v1::prefill_worker_client::PrefillWorkerClient;
use proto::worker::v1::{HealthRequest, HealthResponse, PrefixUpdate, WatchPrefixesRequest};
use tonic::transport::{Channel, Endpoint};

use super::{Kind, LoadBoard};

#[derive(Clone)]
pub(super) enum Client {
    Decode(DecodeWorkerClient<Channel>),
    Prefill(PrefillWorkerClient<Channel>),
}

impl Client {
    pub(super) async fn health(&mut self, req: HealthRequest) -> Result<HealthResponse, tonic::Status> {
        let r = match self {
            Client::Decode(c) => c.health(req).await,
            Client::Prefill(c) => c.health(req).await,
        };
        r.map(tonic::Response::into_inner)
    }

    async fn watch_prefixes(&mut self) -> Result<tonic::Streaming<PrefixUpdate>, tonic::Status> {
        let r = match self {
            Client::Decode(c) => c.watch_prefixes(WatchPrefixesRequest {}).await,
            Client::Prefill(c) => c.watch_prefixes(WatchPrefixesRequest {}).await,
        };
        r.map(tonic::Response::into_inner)
    }
}

/// A worker's watch task, stopped when the worker leaves the poller's targets.
pub(super) struct Watch(pub(super) tokio::task::JoinHandle<()>);

impl Drop for Watch {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Keeps `addr`'s `WatchPrefixes` stream open and applies its updates to the board,
/// until the board goes, the worker leaves (the task is aborted) or the worker does not
/// serve the RPC (it is read from Health reports). A stream that ends, fails or skips
/// an update drops the worker's set and is opened again an `interval` later.
pub(super) async fn watch(board: Weak<LoadBoard>, addr: String, mut client: Client, interval: Duration) {
    loop {
        let why = match client.watch_prefixes().await {
            Err(s) if s.code() == tonic::Code::Unimplemented => return,
            Err(_) => "refused",
            Ok(mut stream) => loop {
                match stream.message().await {
                    Ok(Some(u)) => {
                        let Some(b) = board.upgrade() else { return };
                        match b.apply(&addr, &u) {
                            Ok(blocks) => crate::metrics::worker_prefix_blocks(&addr, blocks),
                            Err(gap) => {
                                tracing::warn!(worker = %addr, %gap, "prefix watch out of sequence; its set is dropped");
                                break "gap";
                            }
                        }
                    }
                    Ok(None) => break "ended",
                    Err(_) => break "failed",
                }
            },
        };
        let Some(b) = board.upgrade() else { return };
        b.unwatch(&addr);
        crate::metrics::worker_prefix_blocks(&addr, 0);
        crate::metrics::prefix_watch_restart(why);
        drop(b);
        tokio::time::sleep(interval).await;
    }
}

pub(super) fn connect(addr: &str, kind: Kind) -> Option<Client> {
    let ep =
        Endpoint::from_shared(format!("http://{addr}")).ok()?.connect_timeout(Duration::from_secs(1)).tcp_nodelay(true);
    let ch = ep.connect_lazy();
    Some(match kind {
        Kind::Decode => Client::Decode(DecodeWorkerClient::new(ch)),
        Kind::Prefill => Client::Prefill(PrefillWorkerClient::new(ch)),
    })
}
