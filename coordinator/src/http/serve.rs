//! The HTTP server loop, with the edges a public endpoint needs: at most
//! `max_connections` connections at once (the rest wait in the kernel's
//! accept backlog), a request head that must arrive within
//! `header_timeout` of the connection starting to send it (hyper closes a
//! slow one: slowloris), the stall guard on writes ([`StallGuard`]), and
//! `TCP_NODELAY`. The body's own timeout is the handlers' (it is read there;
//! see `read_body`). axum's `serve` offers none of these knobs, so this
//! drives hyper directly.
//!
//! Shutdown: once `stop` is cancelled nothing new is accepted, every
//! connection finishes its request in progress and closes (hyper's graceful
//! shutdown), and [`serve`] returns when the last one has.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use super::StallGuard;
use crate::metrics;

/// The HTTP server's edges.
#[derive(Debug, Clone, Copy)]
pub struct ServeSettings {
    /// Connections open at once.
    pub max_connections: usize,
    /// A request head must be read within this long.
    pub header_timeout: Duration,
    /// A write that makes no progress this long closes the connection.
    pub stall_limit: Duration,
    /// Whether this server's open connections are what
    /// `tandem_coordinator_http_connections` shows (the client port: yes; the
    /// metrics listener: no, two servers cannot share one gauge).
    pub counted: bool,
}

/// Serves `app` on `listener` until `stop` is cancelled and every
/// connection has finished.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    settings: ServeSettings,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let max = settings.max_connections.clamp(1, Semaphore::MAX_PERMITS);
    let slots = Arc::new(Semaphore::new(max));
    let counted = settings.counted;
    let open = move |slots: &Semaphore| {
        if counted {
            metrics::http_connections(max - slots.available_permits());
        }
    };
    loop {
        let permit = tokio::select! {
            () = stop.cancelled() => break,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let tcp = tokio::select! {
            () = stop.cancelled() => break,
            r = listener.accept() => match r {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors, or a connection reset before it was
                    // accepted: nothing to serve; do not spin on it.
                    tracing::warn!(error = %e, "accepting an HTTP connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // Tokens are small writes: without TCP_NODELAY, Nagle holds SSE events back ~40 ms.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "setting TCP_NODELAY on an HTTP connection");
        }
        open(slots.as_ref());
        let io = TokioIo::new(StallGuard::new(tcp, settings.stall_limit));
        let service = TowerToHyperService::new(app.clone());
        let (stop, slots) = (stop.clone(), slots.clone());
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(settings.header_timeout);
            let conn = builder.serve_connection(io, service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "HTTP connection ended");
                    }
                }
                () = stop.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(permit);
            open(slots.as_ref());
        });
    }
    // New connections wait in the backlog no more: refused from here on.
    drop(listener);
    // Every connection gives its permit back as it ends.
    let _all = slots.acquire_many(max as u32).await;
    Ok(())
}
