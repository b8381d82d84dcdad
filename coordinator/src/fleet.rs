//! The coordinators of one cluster find each other in etcd, so that a
//! tenant's limits hold for the fleet, not per coordinator.
//!
//! Each coordinator keeps a key `/{prefix}/coordinators/{id}` under a lease
//! of its own (`--fleet-lease-ttl-s`) and watches the range. The number of
//! live keys is the [`Split`]: every tenant budget is divided by it
//! ([`crate::tenants`]). etcd is never on a request's path: requests read
//! the split from memory, and it changes only when a coordinator comes or
//! goes (a membership change re-splits every budget at once).
//!
//! When etcd cannot be reached (or stops answering keepalives within the
//! lease TTL), the split falls back to the larger of the last count seen
//! and `--fleet-min-split`, and stays there until etcd answers again: a
//! coordinator never grows its own share on silence, so the fleet never
//! fails open by losing etcd. docs/ARCHITECTURE.md gives the error bounds.
//!
//! One owned task keeps the lease, the watch and the split; on shutdown it
//! revokes the lease so the others take up the share at once rather than
//! after the TTL.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, GetOptions, PutOptions, WatchOptions};
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use crate::metrics;
use crate::tenants::Split;

/// How this coordinator joins the fleet.
#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub etcd: registry::EtcdConfig,
    /// The cluster prefix (as for workers).
    pub prefix: String,
    /// This coordinator's id (unique among live coordinators).
    pub id: String,
    /// Lease TTL, whole seconds (etcd may raise it to its minimum).
    pub ttl: Duration,
    /// The least split while etcd cannot tell.
    pub min_split: usize,
}

/// The fleet's key range: `/{prefix}/coordinators/`.
pub fn range(prefix: &str) -> Result<String, registry::RegistryError> {
    let workers = registry::ClusterPrefix::new(prefix)?;
    let root = workers.workers().strip_suffix("workers/").unwrap_or("/");
    Ok(format!("{root}coordinators/"))
}

/// A default id: host name and process id.
pub fn default_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let host: String =
        host.trim().chars().filter(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')).collect();
    let host = if host.is_empty() { "coordinator".to_owned() } else { host };
    format!("{host}-{}", std::process::id())
}

/// The other live coordinators, as etcd last said: what a draining
/// coordinator asks before it ends its streams for a peer to resume.
/// 0 while etcd cannot tell (a hand-off is never made on a guess).
#[derive(Debug, Clone, Default)]
pub struct Peers(Arc<AtomicUsize>);

impl Peers {
    /// Live coordinators besides this one.
    pub fn live(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, n: usize) {
        self.0.store(n, Ordering::Relaxed);
    }
}

/// Starts the fleet task; it ends (revoking its lease) when `stop` is cancelled.
pub fn spawn(
    cfg: FleetConfig,
    split: Arc<Split>,
    stop: CancellationToken,
) -> Result<(tokio::task::JoinHandle<()>, Peers), registry::RegistryError> {
    let range = range(&cfg.prefix)?;
    let key = format!("{range}{}", cfg.id);
    split.set(cfg.min_split.max(1));
    metrics::fleet_split(split.get());
    let peers = Peers::default();
    let fleet = Fleet { key, range, cfg, split, last_seen: 1, peers: peers.clone() };
    Ok((tokio::spawn(fleet.run(stop)), peers))
}

struct Fleet {
    key: String,
    range: String,
    cfg: FleetConfig,
    split: Arc<Split>,
    /// The count etcd last gave (ourselves included).
    last_seen: usize,
    peers: Peers,
}

/// Why a session with etcd ended.
enum End {
    Stopped,
    Lost(String),
}

impl Fleet {
    async fn run(mut self, stop: CancellationToken) {
        let mut delay = Duration::from_millis(100);
        loop {
            match self.session(&stop).await {
                End::Stopped => return,
                End::Lost(why) => {
                    self.peers.set(0);
                    let n = self.last_seen.max(self.cfg.min_split).max(1);
                    if self.split.get() != n {
                        tracing::warn!(%why, split = n, "etcd lost: tenant budgets split by the last fleet size seen");
                    } else {
                        tracing::debug!(%why, "fleet session ended; reconnecting");
                    }
                    self.publish_split(n);
                }
            }
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    fn publish_split(&self, n: usize) {
        self.split.set(n);
        metrics::fleet_split(n);
    }

    /// Publishes the live set (ourselves always counted).
    fn publish(&mut self, live: &BTreeSet<String>) {
        let n = live.len() + usize::from(!live.contains(&self.key));
        if n != self.split.get() {
            tracing::info!(coordinators = n, "fleet changed: tenant budgets re-split");
        }
        self.last_seen = n;
        self.peers.set(n - 1);
        self.publish_split(n);
    }

    async fn session(&mut self, stop: &CancellationToken) -> End {
        let t = self.cfg.etcd.request_timeout;
        let lost = |what: &str, e: String| End::Lost(format!("{what}: {e}"));
        let mut client: Client = match self.cfg.etcd.connect().await {
            Ok(c) => c,
            Err(e) => return lost("connect", e.to_string()),
        };
        macro_rules! call {
            ($what:literal, $fut:expr) => {
                match tokio::time::timeout(t, $fut).await {
                    Ok(Ok(v)) => v,
                    Ok(Err(e)) => return lost($what, e.to_string()),
                    Err(_) => return lost($what, format!("no answer within {t:?}")),
                }
            };
        }
        let ttl_s = self.cfg.ttl.as_secs().max(1) as i64;
        let grant = call!("lease grant", client.lease_grant(ttl_s, None));
        let (lease, ttl) = (grant.id(), Duration::from_secs(grant.ttl().max(1) as u64));
        let value = serde_json::json!({"id": self.cfg.id, "pid": std::process::id()}).to_string();
        call!("put", client.put(self.key.clone(), value, Some(PutOptions::new().with_lease(lease))));
        let listed = call!("list", client.get(self.range.clone(), Some(GetOptions::new().with_prefix())));
        let revision = listed.header().map_or(0, |h| h.revision());
        let mut live: BTreeSet<String> =
            listed.kvs().iter().filter_map(|kv| kv.key_str().ok().map(str::to_owned)).collect();
        self.publish(&live);
        let options = WatchOptions::new().with_prefix().with_start_revision(revision + 1);
        let mut watch = call!("watch", client.watch(self.range.clone(), Some(options)));
        let (mut keeper, mut answers) = call!("keepalive", client.lease_keep_alive(lease));
        let interval = (ttl / 3).max(Duration::from_millis(200));
        let mut tick = tokio::time::interval_at(Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut acked = Instant::now();
        loop {
            tokio::select! {
                biased;
                () = stop.cancelled() => {
                    // Peers take up our share now rather than after the TTL.
                    let _ = tokio::time::timeout(t, client.lease_revoke(lease)).await;
                    return End::Stopped;
                }
                answer = answers.message() => match answer {
                    Ok(Some(a)) if a.ttl() > 0 => acked = Instant::now(),
                    Ok(Some(_)) => return End::Lost("the lease expired".into()),
                    Ok(None) => return End::Lost("the keepalive stream ended".into()),
                    Err(e) => return lost("keepalive", e.to_string()),
                },
                event = watch.message() => match event {
                    Ok(Some(w)) => {
                        if w.canceled() {
                            return End::Lost("the watch was cancelled".into());
                        }
                        for e in w.events() {
                            let Some(key) = e.kv().and_then(|kv| kv.key_str().ok()) else { continue };
                            match e.event_type() {
                                etcd_client::EventType::Put => live.insert(key.to_owned()),
                                etcd_client::EventType::Delete => live.remove(key),
                            };
                        }
                        self.publish(&live);
                    }
                    Ok(None) => return End::Lost("the watch ended".into()),
                    Err(e) => return lost("watch", e.to_string()),
                },
                _ = tick.tick() => {
                    // etcd has not confirmed the lease for a whole TTL: the others may
                    // already count us out, and we cannot see them come or go.
                    if acked.elapsed() > ttl {
                        return End::Lost(format!("no keepalive answered within the lease TTL ({ttl:?})"));
                    }
                    if let Err(e) = keeper.keep_alive().await {
                        return lost("keepalive", e.to_string());
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fleet_range_sits_beside_the_workers() {
        assert_eq!(range("tandem").expect("valid"), "/tandem/coordinators/");
        assert_eq!(range("/a/b/").expect("valid"), "/a/b/coordinators/");
        assert!(range("a//b").is_err());
        assert!(!default_id().is_empty());
    }
}
