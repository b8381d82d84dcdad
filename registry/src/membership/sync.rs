//! The task that lists and watches the workers range and publishes views.

use std::collections::BTreeMap;
use std::sync::Arc;

use etcd_client::{Client, EventType, GetOptions, KeyValue, WatchOptions, WatchResponse};
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::{MembershipConfig, MembershipView};
use crate::etcd::{timed, Backoff};
use crate::keys::ClusterPrefix;
use crate::{Role, WorkerInfo};

type Workers = BTreeMap<(Role, String), WorkerInfo>;

/// Why a watch ended.
enum WatchEnd {
    Cancelled,
    Resync(&'static str),
}

pub(super) struct Syncer {
    config: MembershipConfig,
    prefix: ClusterPrefix,
    range_end: Vec<u8>,
    view: watch::Sender<MembershipView>,
    client: Option<Client>,
}

impl Syncer {
    pub(super) fn new(config: MembershipConfig, prefix: ClusterPrefix, view: watch::Sender<MembershipView>) -> Self {
        let range_end = prefix_end(prefix.workers().as_bytes());
        Self { config, prefix, range_end, view, client: None }
    }

    pub(super) async fn run(mut self, cancel: CancellationToken) {
        let mut backoff = Backoff::new(self.config.retry_min, self.config.retry_max);
        loop {
            let delay = backoff.next_delay();
            tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(delay) => {}
            }
            let revision = match self.list().await {
                Ok(revision) => revision,
                Err(e) => {
                    tracing::warn!(prefix = self.prefix.workers(), error = %e, "listing workers failed; serving from cache");
                    self.client = None;
                    self.set_live(false);
                    continue;
                }
            };
            match self.watch(revision, &cancel, &mut backoff).await {
                WatchEnd::Cancelled => return,
                WatchEnd::Resync(why) => {
                    tracing::info!(prefix = self.prefix.workers(), why, "membership watch ended; re-listing");
                    // A fresh client: the old channel may hold dead streams after etcd restarts.
                    self.client = None;
                    self.set_live(false);
                }
            }
        }
    }

    async fn client(&mut self) -> Result<Client, crate::RegistryError> {
        if let Some(c) = &self.client {
            return Ok(c.clone());
        }
        let c = self.config.etcd.connect().await?;
        self.client = Some(c.clone());
        Ok(c)
    }

    /// Lists the whole range at one revision, page by page, and publishes it. Returns the
    /// revision.
    async fn list(&mut self) -> Result<i64, crate::RegistryError> {
        let mut client = self.client().await?;
        let timeout = self.config.etcd.request_timeout;
        let mut workers = Workers::new();
        let mut revision = 0;
        let mut start = self.prefix.workers().as_bytes().to_vec();
        loop {
            let mut options = GetOptions::new().with_range(self.range_end.clone()).with_limit(self.config.page_size);
            if revision > 0 {
                // Later pages read the first page's revision, so the list is one snapshot.
                options = options.with_revision(revision);
            }
            let page = timed("list workers", timeout, client.get(start.clone(), Some(options))).await?;
            if revision == 0 {
                revision = page.header().map_or(0, |h| h.revision());
            }
            for kv in page.kvs() {
                if let Some((slot, info)) = self.decode(kv) {
                    workers.insert(slot, info);
                }
            }
            match page.kvs().last() {
                Some(last) if page.more() => {
                    start = last.key().to_vec();
                    start.push(0);
                }
                _ => break,
            }
        }
        let now = Instant::now();
        self.view.send_modify(|v| {
            // Keys that went away while this cache was not watching (an outage, a restart).
            let gone: Vec<WorkerInfo> =
                v.workers.iter().filter(|(slot, _)| !workers.contains_key(*slot)).map(|(_, w)| w.clone()).collect();
            v.workers = Arc::new(workers);
            v.depart(gone, now);
            v.revision = revision;
            v.live = true;
            v.last_contact = Some(now);
            v.resyncs += 1;
        });
        Ok(revision)
    }

    /// Follows the range from `revision + 1` until the watch fails or the task is cancelled.
    async fn watch(&mut self, revision: i64, cancel: &CancellationToken, backoff: &mut Backoff) -> WatchEnd {
        let mut client = match self.client().await {
            Ok(c) => c,
            Err(_) => return WatchEnd::Resync("connect failed"),
        };
        let options = WatchOptions::new().with_range(self.range_end.clone()).with_start_revision(revision + 1);
        let timeout = self.config.etcd.request_timeout;
        let stream = match timed("watch", timeout, client.watch(self.prefix.workers(), Some(options))).await {
            Ok(s) => s,
            Err(_) => return WatchEnd::Resync("watch could not be created"),
        };
        let (mut requests, mut answers) = stream.split();
        let mut heard = Instant::now();
        let period = self.config.progress_interval;
        let mut progress = tokio::time::interval_at(heard + period, period);
        progress.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return WatchEnd::Cancelled,
                answer = answers.message() => match answer {
                    Err(_) => return WatchEnd::Resync("watch failed"),
                    Ok(None) => return WatchEnd::Resync("watch stream ended"),
                    Ok(Some(answer)) => {
                        heard = Instant::now();
                        if answer.canceled() {
                            return WatchEnd::Resync(if answer.compact_revision() > 0 { "compacted" } else { "canceled" });
                        }
                        if answer.created() {
                            backoff.reset();
                        }
                        self.apply(&answer, heard);
                    }
                },
                () = tokio::time::sleep_until(heard + self.config.silence_timeout) => return WatchEnd::Resync("silent"),
                _ = progress.tick() => {
                    if requests.request_progress().await.is_err() {
                        return WatchEnd::Resync("watch request failed");
                    }
                }
            }
        }
    }

    /// Applies one watch answer. Answers without events (created, progress) only refresh
    /// the contact time and notify no one unless the cache just went live.
    fn apply(&self, answer: &WatchResponse, now: Instant) {
        let revision = answer.header().map_or(0, |h| h.revision());
        if answer.events().is_empty() {
            self.view.send_if_modified(|v| {
                let went_live = !v.live;
                v.live = true;
                v.last_contact = Some(now);
                v.revision = v.revision.max(revision);
                went_live
            });
            return;
        }
        self.view.send_modify(|v| {
            let mut gone = Vec::new();
            let workers = Arc::make_mut(&mut v.workers);
            for event in answer.events() {
                let Some(kv) = event.kv() else { continue };
                match event.event_type() {
                    EventType::Put => match self.decode(kv) {
                        Some((slot, info)) => {
                            workers.insert(slot, info);
                        }
                        // An unreadable value replaced whatever was there: no routable worker.
                        None => {
                            if let Some(slot) = self.slot(kv) {
                                workers.remove(&slot);
                            }
                        }
                    },
                    EventType::Delete => {
                        if let Some(w) = self.slot(kv).and_then(|slot| workers.remove(&slot)) {
                            gone.push(w);
                        }
                    }
                }
            }
            v.depart(gone, now);
            v.revision = v.revision.max(revision);
            v.live = true;
            v.last_contact = Some(now);
        });
    }

    fn slot(&self, kv: &KeyValue) -> Option<(Role, String)> {
        let key = kv.key_str().ok()?;
        let (role, id) = self.prefix.parse_key(key)?;
        Some((role, id.to_owned()))
    }

    /// The worker stored in `kv`, if its key and value agree and validate.
    fn decode(&self, kv: &KeyValue) -> Option<((Role, String), WorkerInfo)> {
        let key = String::from_utf8_lossy(kv.key());
        let Some(slot) = self.slot(kv) else {
            tracing::warn!(%key, "ignoring a key that is not /{{prefix}}/workers/{{role}}/{{id}}");
            return None;
        };
        let info: WorkerInfo = match serde_json::from_slice(kv.value()) {
            Ok(info) => info,
            Err(e) => {
                tracing::warn!(%key, error = %e, "ignoring an unreadable worker value");
                return None;
            }
        };
        if (info.role, info.id.as_str()) != (slot.0, slot.1.as_str()) {
            tracing::warn!(%key, role = %info.role, id = info.id, "ignoring a worker value whose role or id differs from its key");
            return None;
        }
        if let Err(e) = info.validate() {
            tracing::warn!(%key, error = %e, "ignoring an invalid worker value");
            return None;
        }
        Some((slot, info))
    }

    fn set_live(&self, live: bool) {
        self.view.send_if_modified(|v| {
            let changed = v.live != live;
            v.live = live;
            changed
        });
    }
}

/// The end of the range of keys starting with `prefix`.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): to the end of the keyspace.
    vec![0]
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn range_end() {
        assert_eq!(prefix_end(b"/t/workers/"), b"/t/workers0");
        assert_eq!(prefix_end(b"a\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), b"\0");
    }
}
