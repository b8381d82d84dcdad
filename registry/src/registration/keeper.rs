//! The lease keeper: one task that owns the lease, the key and the fence.
//!
//! etcd-client 0.21 has no automatic keepalive: `lease_keep_alive` opens a stream, and the
//! caller sends each keepalive and reads each answer. The stream dies with the connection
//! and is not rebuilt by the client, so this task reopens it (on a fresh client) whenever
//! it fails, and counts time from the last *acknowledged* keepalive to decide when to fence.

use std::time::Duration;

use etcd_client::{
    Client, Compare, CompareOp, LeaseKeepAliveStream, LeaseKeeper, PutOptions, Txn, TxnOp, TxnOpResponse,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::{Command, Fence, FenceReason, RegistrationConfig};
use crate::etcd::{timed, Backoff};
use crate::{RegistryError, WorkerInfo};

/// A granted lease and the send time of its last acknowledged grant or keepalive.
#[derive(Clone, Copy, Debug)]
pub(super) struct Lease {
    pub(super) id: i64,
    ttl: Duration,
    acked_at: Instant,
}

/// What a reachable etcd said is gone.
#[derive(Clone, Copy, Debug)]
enum Lost {
    /// A keepalive answered TTL 0: the lease expired or was revoked (and its key with it).
    LeaseExpired,
    /// A write found the key deleted or held by another lease.
    Key,
}

/// Why the task stops.
enum Stop {
    /// Cancelled (abandoned or dropped): leave the lease to expire.
    Exit,
    /// Revoke the lease, then answer.
    Deregister(oneshot::Sender<Result<(), RegistryError>>),
}

type KeepAlive = (LeaseKeeper, LeaseKeepAliveStream);

pub(super) struct Keeper {
    config: RegistrationConfig,
    key: String,
    info: WorkerInfo,
    client: Option<Client>,
}

impl Keeper {
    /// Registers for the first time, waiting up to `takeover_timeout` for a key of the same id
    /// held by another lease to expire.
    pub(super) async fn start(
        config: RegistrationConfig,
        key: String,
        info: WorkerInfo,
    ) -> Result<(Self, Lease), RegistryError> {
        let deadline = Instant::now() + config.takeover_timeout;
        let mut backoff = Backoff::new(config.retry_min, config.retry_max);
        let mut keeper = Self { config, key, info, client: None };
        loop {
            match keeper.try_register(None).await {
                Ok(lease) => return Ok((keeper, lease)),
                Err(e @ RegistryError::KeyHeld { .. }) => {
                    let delay = backoff.next_delay().max(keeper.config.retry_min);
                    if Instant::now() + delay > deadline {
                        return Err(e);
                    }
                    tracing::info!(key = %keeper.key, error = %e, "waiting for the previous holder's lease to expire");
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub(super) async fn run(
        mut self,
        mut lease: Lease,
        fence: watch::Sender<Fence>,
        mut commands: mpsc::Receiver<Command>,
        cancel: CancellationToken,
    ) {
        tracing::info!(key = %self.key, lease = format_args!("{:x}", lease.id), ttl = ?lease.ttl, "registered");
        let stop = loop {
            let lost = match self.serve(&lease, &mut commands, &cancel).await {
                Ok(lost) => lost,
                Err(stop) => break stop,
            };
            // etcd answered: the lease or the key is gone. Still serving: the worker did
            // nothing wrong, and unless another lease holds the key nobody else has its id.
            tracing::warn!(key = %self.key, lease = format_args!("{:x}", lease.id), ?lost, "lease or key lost; claiming the key again");
            lease = match self.reclaim(lease.id, &fence, &mut commands, &cancel).await {
                Ok(new) => new,
                Err(stop) => break stop,
            };
            let was_fenced = !fence.borrow().is_serving();
            fence.send_replace(Fence::Serving { lease_id: lease.id });
            tracing::info!(key = %self.key, lease = format_args!("{:x}", lease.id), was_fenced, "re-registered");
        };
        fence.send_replace(Fence::Stopped);
        if let Stop::Deregister(reply) = stop {
            let result = self.revoke(lease.id).await;
            tracing::info!(key = %self.key, ok = result.is_ok(), "deregistered");
            // The caller may have given up waiting; nothing to do then.
            let _ = reply.send(result);
        }
    }

    /// Keeps `lease` alive and serves commands until a reachable etcd says the lease or the
    /// key is gone. An unreachable etcd ends nothing: the worker serves on (static
    /// stability) and keeps trying, however long it lasts.
    async fn serve(
        &mut self,
        lease: &Lease,
        commands: &mut mpsc::Receiver<Command>,
        cancel: &CancellationToken,
    ) -> Result<Lost, Stop> {
        let interval = lease.ttl / 3;
        // etcd refreshed the lease no earlier than we sent the keepalive, so it cannot expire
        // before `sent + ttl`: only past that may it be gone. Logged once per silence.
        let mut lapse_logged = false;
        let op_timeout = interval.min(self.config.etcd.request_timeout);
        let mut acked_at = lease.acked_at;
        let mut stream: Option<KeepAlive> = None;
        let mut pending: Option<Instant> = None;
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return Err(Stop::Exit),
                msg = next_answer(&mut stream) => match msg {
                    Ok(Some(answer)) if answer.ttl() > 0 => {
                        if let Some(sent) = pending.take() {
                            acked_at = acked_at.max(sent);
                            lapse_logged = false;
                        }
                    }
                    Ok(Some(_)) => return Ok(Lost::LeaseExpired),
                    Ok(None) | Err(_) => {
                        tracing::debug!(key = %self.key, "keepalive stream ended; reopening");
                        (stream, pending, self.client) = (None, None, None);
                    }
                },
                () = tokio::time::sleep_until(acked_at + lease.ttl), if !lapse_logged => {
                    lapse_logged = true;
                    tracing::warn!(key = %self.key, ttl = ?lease.ttl, "no keepalive acknowledged for the lease TTL: etcd is unreachable and may expire the lease; serving on");
                }
                cmd = commands.recv() => match cmd {
                    None => return Err(Stop::Exit),
                    Some(Command::Deregister(reply)) => return Err(Stop::Deregister(reply)),
                    Some(Command::SetDraining(draining, reply)) => {
                        self.info.draining = draining;
                        match self.write_info(lease.id).await {
                            Ok(true) => {
                                let _ = reply.send(Ok(()));
                            }
                            Ok(false) => {
                                // Kept in `info`; the re-registration writes it.
                                let _ = reply.send(Ok(()));
                                return Ok(Lost::Key);
                            }
                            Err(e) => {
                                self.client = None;
                                let _ = reply.send(Err(e));
                            }
                        }
                    }
                },
                _ = tick.tick() => {
                    // An answer overdue by a whole interval: the stream may be silently dead.
                    if stream.is_some() && pending.is_some_and(|p| p.elapsed() >= interval) {
                        tracing::debug!(key = %self.key, "keepalive answer overdue; reopening");
                        (stream, pending, self.client) = (None, None, None);
                    }
                    if let Some((keeper, _)) = &mut stream {
                        pending.get_or_insert_with(Instant::now);
                        if keeper.keep_alive().await.is_err() {
                            (stream, pending, self.client) = (None, None, None);
                        }
                    } else {
                        let sent = Instant::now();
                        match self.open_keepalive(lease.id, op_timeout).await {
                            // Opening sends one keepalive and waits for its answer.
                            Ok(Some(s)) => {
                                acked_at = acked_at.max(sent);
                                lapse_logged = false;
                                stream = Some(s);
                            }
                            Ok(None) => return Ok(Lost::LeaseExpired),
                            Err(e) => {
                                tracing::debug!(key = %self.key, error = %e, "opening keepalive failed");
                                self.client = None;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Claims the key again under a fresh lease, retrying with bounded backoff until it
    /// succeeds or the task is stopped. Fences only while another lease holds the key:
    /// then another process has this worker's id. An etcd error is no such answer: the
    /// worker serves on and retries.
    async fn reclaim(
        &mut self,
        old: i64,
        fence: &watch::Sender<Fence>,
        commands: &mut mpsc::Receiver<Command>,
        cancel: &CancellationToken,
    ) -> Result<Lease, Stop> {
        let mut backoff = Backoff::new(self.config.retry_min, self.config.retry_max);
        let mut first = true;
        loop {
            // The first attempt at once: a healthy worker's key is absent only briefly.
            let wake = tokio::time::sleep(if first { Duration::ZERO } else { backoff.next_delay() });
            first = false;
            tokio::pin!(wake);
            loop {
                tokio::select! {
                    biased;
                    () = cancel.cancelled() => return Err(Stop::Exit),
                    cmd = commands.recv() => match cmd {
                        None => return Err(Stop::Exit),
                        Some(Command::Deregister(reply)) => return Err(Stop::Deregister(reply)),
                        Some(Command::SetDraining(draining, reply)) => {
                            // Written by the claim.
                            self.info.draining = draining;
                            let _ = reply.send(Ok(()));
                        }
                    },
                    () = &mut wake => break,
                }
            }
            match self.try_register(Some(old)).await {
                Ok(lease) => return Ok(lease),
                // Lease 0: the key moved under us three times; no holder to name, so no answer yet.
                Err(RegistryError::KeyHeld { lease: holder, .. }) if holder != 0 => {
                    if fence.borrow().is_serving() {
                        fence.send_replace(Fence::Fenced { reason: FenceReason::KeyTaken { lease: holder } });
                        tracing::warn!(key = %self.key, holder = format_args!("{holder:x}"), "fenced: another lease holds this worker's key; taking no new work");
                    }
                }
                Err(e) => {
                    tracing::warn!(key = %self.key, error = %e, "re-registration failed; serving on and retrying")
                }
            }
        }
    }

    async fn client(&mut self) -> Result<Client, RegistryError> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let c = self.config.etcd.connect().await?;
        self.client = Some(c.clone());
        Ok(c)
    }

    /// Grants a lease and claims the key with it; on success revokes `old` (best effort).
    async fn try_register(&mut self, old: Option<i64>) -> Result<Lease, RegistryError> {
        let result = self.try_register_inner(old).await;
        if matches!(result, Err(RegistryError::Etcd { .. } | RegistryError::Timeout { .. })) {
            self.client = None;
        }
        result
    }

    async fn try_register_inner(&mut self, old: Option<i64>) -> Result<Lease, RegistryError> {
        let mut client = self.client().await?;
        let timeout = self.config.etcd.request_timeout;
        let value = serde_json::to_vec(&self.info)?;
        let sent = Instant::now();
        let ttl_secs = i64::try_from(self.config.ttl.as_secs()).unwrap_or(i64::MAX);
        let granted = timed("lease grant", timeout, client.lease_grant(ttl_secs, None)).await?;
        let ttl = Duration::from_secs(u64::try_from(granted.ttl()).unwrap_or(0).max(1));
        let lease = Lease { id: granted.id(), ttl, acked_at: sent };
        if let Err(e) = self.claim(&mut client, &value, lease.id, old).await {
            // Best effort: an unused lease expires by itself anyway.
            let _ = timed("lease revoke", timeout, client.lease_revoke(lease.id)).await;
            return Err(e);
        }
        if let Some(old) = old.filter(|&o| o != lease.id) {
            // The old lease holds no key any more; revoking only tidies up.
            let _ = timed("lease revoke", timeout, client.lease_revoke(old)).await;
        }
        Ok(lease)
    }

    /// Writes the key under `lease` if it is absent, unleased, or held by `old`.
    async fn claim(
        &self,
        client: &mut Client,
        value: &[u8],
        lease: i64,
        old: Option<i64>,
    ) -> Result<(), RegistryError> {
        let timeout = self.config.etcd.request_timeout;
        let key = self.key.as_str();
        let put = || TxnOp::put(key, value, Some(PutOptions::new().with_lease(lease)));
        // A key deleted between the two transactions is retried once more.
        let mut holder = 0;
        for _ in 0..3 {
            let absent = Txn::new()
                .when([Compare::create_revision(key, CompareOp::Equal, 0)])
                .and_then([put()])
                .or_else([TxnOp::get(key, None)]);
            let answer = timed("claim key", timeout, client.txn(absent)).await?;
            if answer.succeeded() {
                return Ok(());
            }
            let held_by = answer.op_responses().into_iter().find_map(|r| match r {
                TxnOpResponse::Get(g) => g.kvs().first().map(|kv| kv.lease()),
                _ => None,
            });
            let Some(h) = held_by else { continue };
            holder = h;
            if h != 0 && Some(h) != old {
                break;
            }
            let ours = Txn::new().when([Compare::lease(key, CompareOp::Equal, h)]).and_then([put()]);
            if timed("claim key", timeout, client.txn(ours)).await?.succeeded() {
                return Ok(());
            }
        }
        Err(RegistryError::KeyHeld { key: self.key.clone(), lease: holder })
    }

    /// Rewrites the value under the same lease; `Ok(false)` if the key is no longer ours.
    async fn write_info(&mut self, lease: i64) -> Result<bool, RegistryError> {
        let mut client = self.client().await?;
        let value = serde_json::to_vec(&self.info)?;
        let key = self.key.as_str();
        let txn = Txn::new().when([Compare::lease(key, CompareOp::Equal, lease)]).and_then([TxnOp::put(
            key,
            value,
            Some(PutOptions::new().with_lease(lease)),
        )]);
        let answer = timed("update key", self.config.etcd.request_timeout, client.txn(txn)).await?;
        Ok(answer.succeeded())
    }

    /// Opens a keepalive stream: `Ok(None)` if etcd says the lease does not exist.
    async fn open_keepalive(&mut self, lease: i64, timeout: Duration) -> Result<Option<KeepAlive>, RegistryError> {
        let mut client = self.client().await?;
        match timed("lease keepalive", timeout, client.lease_keep_alive(lease)).await {
            Ok(s) => Ok(Some(s)),
            Err(RegistryError::Etcd { source: etcd_client::Error::LeaseKeepAliveError(m), .. })
                if m.contains("not found") =>
            {
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Revokes `lease`; a lease that is already gone counts as revoked.
    async fn revoke(&mut self, lease: i64) -> Result<(), RegistryError> {
        let mut client = self.client().await?;
        match timed("lease revoke", self.config.etcd.request_timeout, client.lease_revoke(lease)).await {
            Ok(_) => Ok(()),
            Err(RegistryError::Etcd { source: etcd_client::Error::GRpcStatus(s), .. })
                if s.code() == tonic::Code::NotFound =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

/// The next keepalive answer, or never while no stream is open.
async fn next_answer(
    stream: &mut Option<KeepAlive>,
) -> Result<Option<etcd_client::LeaseKeepAliveResponse>, etcd_client::Error> {
    match stream {
        Some((_, answers)) => answers.message().await,
        None => std::future::pending().await,
    }
}
