//! A worker's registration: its [`WorkerInfo`] under a lease, kept alive by one owned task.
//!
//! # Fencing, and static stability
//! The task publishes a [`Fence`] on a `watch` channel. The worker accepts new work only
//! while it reads [`Fence::Serving`]. etcd is the control plane, not the data plane: a
//! worker that cannot reach it keeps serving, however long that lasts (coordinators route
//! from their cached membership to workers that answer their health checks; see
//! `docs/REGISTRY.md` for the bound and the split-brain argument). So the task fences
//! only on an *answer* from etcd:
//! - a keepalive answers TTL 0 (the lease expired or was revoked), or a write finds the key
//!   deleted or held by another lease: the task claims the key again at once under a fresh
//!   lease, still serving. If the key is free that succeeds and nothing changes for the
//!   worker: nobody else has its id. If another lease holds the key, another process
//!   registered this id: the task flips to [`Fence::Fenced`] ([`FenceReason::KeyTaken`])
//!   and stays there until it holds the key again.
//! - An etcd that does not answer (down, paused, partitioned) fences nothing; the task keeps
//!   reopening the keepalive and logs once per silence that the lease may lapse.
//!
//! Being cut off from the coordinators is the worker's other reason to fence; the worker
//! decides that itself (it sees their health checks), not this crate.
//!
//! # Claiming the key
//! The key is written with a transaction that succeeds only if the key is absent, has no
//! lease, or is held by this registration's previous lease; so two processes with the same
//! worker id cannot both be registered. At start-up a key held by another lease (a crashed
//! predecessor with the same id) is waited for up to
//! [`RegistrationConfig::takeover_timeout`], then [`RegistryError::KeyHeld`] is returned.

mod keeper;

use std::time::Duration;

use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::etcd::EtcdConfig;
use crate::keys::ClusterPrefix;
use crate::{RegistryError, WorkerInfo};

/// How to register.
#[derive(Clone, Debug)]
pub struct RegistrationConfig {
    /// Where etcd is.
    pub etcd: EtcdConfig,
    /// The cluster prefix (see [`crate::keys`]).
    pub prefix: String,
    /// Lease TTL, whole seconds, at least 1 s. etcd may raise it to its minimum (about
    /// 1.5 × its election timeout); the granted TTL is the one enforced. Default 5 s.
    pub ttl: Duration,
    /// At start-up, how long to wait for a key of the same id held by another lease to
    /// expire before giving up with [`RegistryError::KeyHeld`]. Default 15 s.
    pub takeover_timeout: Duration,
    /// First wait between re-registration attempts; doubles up to `retry_max`. Default 100 ms.
    pub retry_min: Duration,
    /// Longest wait between re-registration attempts. Default 2 s.
    pub retry_max: Duration,
}

impl RegistrationConfig {
    /// Defaults for the given etcd and prefix.
    pub fn new(etcd: EtcdConfig, prefix: impl Into<String>) -> Self {
        Self {
            etcd,
            prefix: prefix.into(),
            ttl: Duration::from_secs(5),
            takeover_timeout: Duration::from_secs(15),
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(2),
        }
    }

    fn validate(&self) -> Result<ClusterPrefix, RegistryError> {
        self.etcd.validate()?;
        if self.ttl < Duration::from_secs(1) || self.ttl.subsec_nanos() != 0 {
            return Err(RegistryError::invalid("ttl", format!("{:?} is not a whole number of seconds >= 1", self.ttl)));
        }
        if self.retry_min.is_zero() || self.retry_max < self.retry_min {
            return Err(RegistryError::invalid("retry_min", "must be above zero and at most retry_max"));
        }
        ClusterPrefix::new(&self.prefix)
    }
}

/// Whether the worker may take new work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fence {
    /// Take new work: registered, or unable to reach etcd (which then may have expired the
    /// lease; nobody else has claimed the key, or etcd would have said so).
    Serving {
        /// The last lease granted; the key is attached to it as far as this worker knows.
        lease_id: i64,
    },
    /// Another process holds this worker's key; re-claiming it is under way. Take no new work.
    Fenced {
        /// Why.
        reason: FenceReason,
    },
    /// Deregistered, abandoned or dropped. Take no new work.
    Stopped,
}

impl Fence {
    /// True only for [`Fence::Serving`].
    pub fn is_serving(&self) -> bool {
        matches!(self, Fence::Serving { .. })
    }

    /// The live lease, while serving.
    pub fn lease_id(&self) -> Option<i64> {
        match self {
            Fence::Serving { lease_id } => Some(*lease_id),
            _ => None,
        }
    }
}

/// Why a registration fenced itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FenceReason {
    /// A reachable etcd said this registration's lease or key is gone, and the key is held
    /// by another lease: another process registered this worker id.
    KeyTaken {
        /// The lease holding the key.
        lease: i64,
    },
}

enum Command {
    SetDraining(bool, oneshot::Sender<Result<(), RegistryError>>),
    Deregister(oneshot::Sender<Result<(), RegistryError>>),
}

/// A live registration. Dropping it stops the keepalive without revoking the lease: the key
/// disappears when the lease expires, as for a crashed worker. Call
/// [`Registration::deregister`] to remove it at once.
#[derive(Debug)]
pub struct Registration {
    key: String,
    fence: watch::Receiver<Fence>,
    commands: mpsc::Sender<Command>,
    cancel: CancellationToken,
    task: Option<JoinHandle<()>>,
    reply_timeout: Duration,
}

impl Registration {
    /// Validates `info`, grants a lease, claims the worker's key and starts the keepalive
    /// task. Returns once the worker is registered ([`Fence::Serving`]).
    pub async fn register(config: RegistrationConfig, info: WorkerInfo) -> Result<Self, RegistryError> {
        let prefix = config.validate()?;
        info.validate()?;
        let key = prefix.worker_key(info.role, &info.id);
        // A command waits at most for one registration attempt in progress (grant, claim
        // transactions, revokes) and its own write.
        let reply_timeout = config.etcd.connect_timeout * 2 + config.etcd.request_timeout * 10;
        let (keeper, lease) = keeper::Keeper::start(config, key.clone(), info).await?;
        let (fence_tx, fence) = watch::channel(Fence::Serving { lease_id: lease.id });
        let (commands, rx) = mpsc::channel(8);
        let cancel = CancellationToken::new();
        let task = tokio::spawn(keeper.run(lease, fence_tx, rx, cancel.clone()));
        Ok(Self { key, fence, commands, cancel, task: Some(task), reply_timeout })
    }

    /// The etcd key this worker is registered under.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// A receiver of the fence state; it changes on every flip.
    pub fn fence(&self) -> watch::Receiver<Fence> {
        self.fence.clone()
    }

    /// The fence state now.
    pub fn current(&self) -> Fence {
        self.fence.borrow().clone()
    }

    /// Whether the worker may take new work now.
    pub fn is_serving(&self) -> bool {
        self.fence.borrow().is_serving()
    }

    /// Sets the draining flag. While serving it is written under the same lease before this
    /// returns; while fenced it is kept and written by the re-registration. An error means
    /// the write was not confirmed; the flag is still kept for the next write.
    pub async fn set_draining(&self, draining: bool) -> Result<(), RegistryError> {
        self.ask(|reply| Command::SetDraining(draining, reply)).await
    }

    /// Revokes the lease (removing the key at once) and stops the task.
    pub async fn deregister(mut self) -> Result<(), RegistryError> {
        let result = self.ask(Command::Deregister).await;
        self.join().await;
        result
    }

    /// Stops the keepalive without revoking: the key stays until the lease expires.
    pub async fn abandon(mut self) {
        self.cancel.cancel();
        self.join().await;
    }

    async fn ask(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<(), RegistryError>>) -> Command,
    ) -> Result<(), RegistryError> {
        let (reply, answer) = oneshot::channel();
        self.commands.send(make(reply)).await.map_err(|_| RegistryError::Stopped)?;
        match tokio::time::timeout(self.reply_timeout, answer).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(RegistryError::Stopped),
            Err(_) => Err(RegistryError::Timeout { op: "registration command", after: self.reply_timeout }),
        }
    }

    async fn join(&mut self) {
        if let Some(task) = self.task.take() {
            if let Err(e) = task.await {
                tracing::error!(key = %self.key, error = %e, "registration task failed");
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
