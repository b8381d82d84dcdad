//! The accepted connections of a tandem gRPC server.
//!
//! tonic's `TcpIncoming::from(listener)` leaves `TCP_NODELAY` off (its
//! builder's `tcp_nodelay` setting is ignored for a listener passed in), so
//! Nagle's algorithm held a streamed token back whenever an earlier small
//! write was still unacknowledged, until the peer's delayed ACK (40 ms on
//! Linux) released it. Token streams carry one small frame per token: in
//! `tandem bench interference` the coordinator received the decode worker's
//! tokens in bursts of four or five after 40-50 ms stalls, none of which the
//! decode worker's own inter-token histogram showed. Every gRPC server here
//! (workers, the coordinator's frontend) takes its connections from
//! [`incoming`].

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

/// Connections accepted on `listener`, each with `TCP_NODELAY` set.
pub fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn accepted_connections_have_nodelay_set() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut accepted = incoming(listener);
        let _client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let stream = tokio::time::timeout(std::time::Duration::from_secs(30), accepted.next())
            .await
            .expect("a connection accepted within 30 s")
            .expect("the listener is open")
            .expect("accept");
        assert!(stream.nodelay().expect("TCP_NODELAY readable"), "Nagle is on for an accepted gRPC connection");
    }
}
