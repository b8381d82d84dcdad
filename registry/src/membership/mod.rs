//! The coordinator's view of who is alive: a watch-fed cache of every worker under the
//! cluster prefix.
//!
//! One task owns the cache. It lists the range with plain paginated `get`s (not
//! `get_stream`, which etcd 3.4 lacks), then watches from the list's revision + 1. On a
//! watch error, end, cancellation, compaction, or silence (no answer to periodic progress
//! requests within [`MembershipConfig::silence_timeout`]) it drops its client and lists
//! again, with bounded backoff when etcd is unreachable.
//!
//! Readers get a [`MembershipView`] without any etcd round trip. While etcd is unreachable
//! the last view stays readable and [`Membership::last_sync_age`] grows, so the coordinator
//! can keep serving from the cache for a bounded time of its own choosing.

mod sync;
mod view;

pub use view::MembershipView;

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::etcd::EtcdConfig;
use crate::keys::ClusterPrefix;
use crate::{RegistryError, Role, WorkerInfo};

/// How to follow membership.
#[derive(Clone, Debug)]
pub struct MembershipConfig {
    /// Where etcd is.
    pub etcd: EtcdConfig,
    /// The cluster prefix (see [`crate::keys`]).
    pub prefix: String,
    /// How often to ask etcd to confirm the watch is current. Default 1 s.
    pub progress_interval: Duration,
    /// A watch that says nothing for this long is treated as dead. Default 3 s; must exceed
    /// `progress_interval`.
    pub silence_timeout: Duration,
    /// First wait between failed lists; doubles up to `retry_max`. Default 100 ms.
    pub retry_min: Duration,
    /// Longest wait between failed lists. Default 2 s.
    pub retry_max: Duration,
    /// Keys per `get` page while listing. Default 500.
    pub page_size: i64,
    /// How long a worker whose key disappeared while it was not draining stays in
    /// [`MembershipView::departed`] (and so in [`MembershipView::routable`]). Covers the
    /// gap between etcd expiring a healthy worker's lease during an outage and the worker
    /// claiming its key again (a keepalive interval plus a claim, about 2 s with 5 s
    /// leases). Zero: none kept. Default 10 s.
    pub departed_grace: Duration,
}

impl MembershipConfig {
    /// Defaults for the given etcd and prefix.
    pub fn new(etcd: EtcdConfig, prefix: impl Into<String>) -> Self {
        Self {
            etcd,
            prefix: prefix.into(),
            progress_interval: Duration::from_secs(1),
            silence_timeout: Duration::from_secs(3),
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(2),
            page_size: 500,
            departed_grace: Duration::from_secs(10),
        }
    }

    fn validate(&self) -> Result<ClusterPrefix, RegistryError> {
        self.etcd.validate()?;
        if self.progress_interval.is_zero() {
            return Err(RegistryError::invalid("progress_interval", "must be above zero"));
        }
        if self.silence_timeout <= self.progress_interval {
            return Err(RegistryError::invalid("silence_timeout", "must exceed progress_interval"));
        }
        if self.retry_min.is_zero() || self.retry_max < self.retry_min {
            return Err(RegistryError::invalid("retry_min", "must be above zero and at most retry_max"));
        }
        if self.page_size < 1 {
            return Err(RegistryError::invalid("page_size", "must be at least 1"));
        }
        ClusterPrefix::new(&self.prefix)
    }
}

/// A running membership cache. Dropping it stops the task.
#[derive(Debug)]
pub struct Membership {
    view: watch::Receiver<MembershipView>,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
    silence_timeout: Duration,
}

impl Membership {
    /// Validates `config` and starts following etcd; returns at once. Use
    /// [`Membership::wait_synced`] to wait for the first list.
    pub async fn start(config: MembershipConfig) -> Result<Self, RegistryError> {
        let prefix = config.validate()?;
        let (tx, view) =
            watch::channel(MembershipView { departed_grace: config.departed_grace, ..MembershipView::empty() });
        let cancel = CancellationToken::new();
        let silence_timeout = config.silence_timeout;
        let task = tokio::spawn(sync::Syncer::new(config, prefix, tx).run(cancel.clone()));
        Ok(Self { view, cancel, task: Some(task), silence_timeout })
    }

    /// Waits up to `timeout` for the first successful list.
    pub async fn wait_synced(&self, timeout: Duration) -> Result<MembershipView, RegistryError> {
        let mut rx = self.view.clone();
        let synced = tokio::time::timeout(timeout, rx.wait_for(|v| v.last_contact.is_some())).await;
        match synced {
            Ok(Ok(v)) => Ok(v.clone()),
            Ok(Err(_)) => Err(RegistryError::Stopped),
            Err(_) => Err(RegistryError::Timeout { op: "first membership list", after: timeout }),
        }
    }

    /// The current view (a cheap clone).
    pub fn view(&self) -> MembershipView {
        self.view.borrow().clone()
    }

    /// A receiver that changes whenever a worker appears, changes or disappears, and when the
    /// cache goes live or stops being live. Progress confirmations update the view's
    /// [`MembershipView::last_contact`] without a change notification.
    pub fn subscribe(&self) -> watch::Receiver<MembershipView> {
        self.view.clone()
    }

    /// Whether the cache follows etcd: a watch is established and etcd confirmed it within
    /// the silence timeout.
    pub fn healthy(&self) -> bool {
        let v = self.view.borrow();
        v.live && v.sync_age().is_some_and(|age| age <= self.silence_timeout)
    }

    /// Time since etcd last confirmed the cache; `None` before the first list.
    pub fn last_sync_age(&self) -> Option<Duration> {
        self.view.borrow().sync_age()
    }

    /// The routable (not draining) workers of one role in one version group, cloned.
    pub fn select(&self, role: Role, version_group: &str) -> Vec<WorkerInfo> {
        self.view.borrow().select(role, version_group).cloned().collect()
    }

    /// Stops the task and waits for it.
    pub async fn stop(mut self) {
        self.cancel.cancel();
        if let Some(task) = self.task.take() {
            if let Err(e) = task.await {
                tracing::error!(error = %e, "membership task failed");
            }
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
