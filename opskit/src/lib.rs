//! Tools for acting on running tandem processes from outside, written once: what the
//! drills (`tandem drill`, product code) and every crate's tests of real processes use.
//!
//! - [`http`]: an HTTP/1.1 client on hyper (JSON requests, status + headers + body, SSE
//!   streams), async and blocking, every exchange bounded;
//! - [`prom`]: the Prometheus text format parsed, and metric lookups by name and labels that
//!   fail when the series is missing (a renamed metric must not read as 0);
//! - [`process`]: start a workspace binary, read its `listening NAME=ADDR` lines within a
//!   bound, keep its stderr in a log file, signal it, kill it on drop;
//! - [`proxy`]: a fault-injecting TCP proxy (flip, hold, buffer, reset, delay, reorder,
//!   blackhole, freeze);
//! - [`sse`]: an incremental server-sent-events parser, bytes in and whole events out,
//!   that never splits a UTF-8 character (the HTTP client's streams and the load
//!   generator both read through it);
//! - [`wait`]: bounded polling whose error says what did not happen;
//! - [`etcd`]: a real etcd (one member or a cluster) on loopback ports;
//!
//! Seeded test data comes from `types::rng`, the workspace's one small generator.
//!
//! Product code, held to its rules (no `unwrap` on what a peer or the system can
//! influence; typed errors). Must not: depend on a crate of this workspace beyond the leaf
//! `types` (every crate takes it as a dev-dependency, so a dependency back would be a
//! cycle), know a metric's name (callers pass the constants of `facts::metrics`), or wait
//! without a bound.

#![forbid(unsafe_code)]

pub mod etcd;
pub mod http;
pub mod process;
pub mod prom;
pub mod proxy;
pub mod sse;
pub mod wait;

pub use wait::{eventually, poll, within};

/// Why a harness step failed. Each variant's text says what was being done.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A bounded wait ran out; the text says what did not happen within which bound.
    #[error("timed out: {0}")]
    Timeout(String),
    /// An HTTP exchange failed: connect, send, read, or an answer that is not HTTP.
    #[error("http: {0}")]
    Http(String),
    /// A metric series is missing from a page, or the page is not the text format.
    #[error("metrics: {0}")]
    Metric(String),
    /// A process could not be found, started, signalled or waited for.
    #[error("process: {0}")]
    Process(String),
    /// A socket or file operation of the harness itself failed (binding a proxy, a log file).
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io { what: what.into(), source }
    }
}

/// Result of a harness step.
pub type Result<T, E = Error> = std::result::Result<T, E>;
