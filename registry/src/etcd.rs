//! Connecting to etcd, and bounding every call.
//!
//! `etcd_client::Client::connect` is lazy: it never fails for an unreachable endpoint, and
//! a request to one may wait for a connection indefinitely. So every call here goes through
//! [`timed`], and the long-running tasks drop their client and connect afresh after a
//! failure instead of trusting a channel that may hold dead streams.

use std::future::Future;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use crate::RegistryError;

/// Where etcd is and how long to wait for it.
#[derive(Clone, Debug)]
pub struct EtcdConfig {
    /// Client URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Bound on establishing a connection. Default 2 s.
    pub connect_timeout: Duration,
    /// Bound on each unary request (get, put, txn, lease grant/revoke). Default 2 s.
    pub request_timeout: Duration,
}

impl EtcdConfig {
    /// Defaults for the given endpoints.
    pub fn new<S: Into<String>>(endpoints: impl IntoIterator<Item = S>) -> Self {
        Self {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            connect_timeout: Duration::from_secs(2),
            request_timeout: Duration::from_secs(2),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), RegistryError> {
        if self.endpoints.is_empty() {
            return Err(RegistryError::invalid("etcd.endpoints", "at least one endpoint is needed"));
        }
        if let Some(e) = self.endpoints.iter().find(|e| e.trim().is_empty()) {
            return Err(RegistryError::invalid("etcd.endpoints", format!("{e:?} is empty")));
        }
        if self.connect_timeout.is_zero() {
            return Err(RegistryError::invalid("etcd.connect_timeout", "must be above zero"));
        }
        if self.request_timeout.is_zero() {
            return Err(RegistryError::invalid("etcd.request_timeout", "must be above zero"));
        }
        Ok(())
    }

    /// A fresh client. Cheap: the connection itself is made on the first request.
    ///
    /// Every request requires a leader (etcd's `hasleader` metadata): a member cut off
    /// from quorum refuses unary calls and cancels watch and keepalive streams instead of
    /// serving them locally. Without it, a watch on the one surviving member of a cluster
    /// that lost quorum kept answering progress requests, so the membership cache stayed
    /// "healthy" indefinitely while no lease could be renewed.
    pub async fn connect(&self) -> Result<Client, RegistryError> {
        let options = ConnectOptions::new().with_connect_timeout(self.connect_timeout).with_require_leader(true);
        timed("connect", self.connect_timeout, Client::connect(&self.endpoints, Some(options))).await
    }
}

/// Runs one etcd call under `after`, mapping its failure to [`RegistryError`].
pub(crate) async fn timed<T>(
    op: &'static str,
    after: Duration,
    call: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, RegistryError> {
    match tokio::time::timeout(after, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(source)) => Err(RegistryError::Etcd { op, source }),
        Err(_) => Err(RegistryError::Timeout { op, after }),
    }
}

/// Bounded exponential backoff for retry loops.
#[derive(Debug)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    next: Duration,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration) -> Self {
        Self { min, max, next: Duration::ZERO }
    }

    /// The wait before the next attempt: zero first, then `min`, doubling up to `max`.
    pub(crate) fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = if d.is_zero() { self.min } else { (d * 2).min(self.max) };
        d
    }

    pub(crate) fn reset(&mut self) {
        self.next = Duration::ZERO;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_bounded() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(350));
        let seq: Vec<u128> = (0..5).map(|_| b.next_delay().as_millis()).collect();
        assert_eq!(seq, [0, 100, 200, 350, 350]);
        b.reset();
        assert_eq!(b.next_delay(), Duration::ZERO);
    }
}
