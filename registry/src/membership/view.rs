//! An immutable snapshot of membership, cheap to clone and read on the request path.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::{Role, WorkerInfo};

/// The workers known at one etcd revision, plus how fresh that knowledge is.
///
/// Cloning shares the worker map. Read it freely: nothing here talks to etcd.
#[derive(Clone, Debug)]
pub struct MembershipView {
    pub(super) workers: Arc<BTreeMap<(Role, String), WorkerInfo>>,
    /// Workers whose key went away while they were not draining, and when this cache saw it;
    /// read through [`MembershipView::departed`] within `departed_grace`.
    pub(super) departed: Arc<BTreeMap<(Role, String), (WorkerInfo, Instant)>>,
    pub(super) departed_grace: Duration,
    pub(super) revision: i64,
    pub(super) live: bool,
    pub(super) last_contact: Option<Instant>,
    pub(super) resyncs: u64,
}

impl MembershipView {
    pub(super) fn empty() -> Self {
        Self {
            workers: Arc::default(),
            departed: Arc::default(),
            departed_grace: Duration::ZERO,
            revision: 0,
            live: false,
            last_contact: None,
            resyncs: 0,
        }
    }

    /// Records that the workers in `gone` left the registry now: the not-draining ones are
    /// kept as departed for the grace. A key that comes back leaves the departed set.
    pub(super) fn depart(&mut self, gone: impl IntoIterator<Item = WorkerInfo>, now: Instant) {
        let grace = self.departed_grace;
        let departed = Arc::make_mut(&mut self.departed);
        departed.retain(|_, (_, at)| now.saturating_duration_since(*at) < grace);
        for w in gone {
            if !w.draining && !grace.is_zero() {
                departed.insert((w.role, w.id.clone()), (w, now));
            }
        }
        let workers = &self.workers;
        departed.retain(|slot, _| !workers.contains_key(slot));
    }

    /// Every known worker, ordered by role then id.
    pub fn workers(&self) -> impl Iterator<Item = &WorkerInfo> + '_ {
        self.workers.values()
    }

    /// Workers whose key was deleted (or expired) while they were not draining, within the
    /// last `departed_grace` (see [`crate::MembershipConfig::departed_grace`]), ordered by
    /// role then id. A worker that deregisters drains first, so it is never here; one whose
    /// key comes back leaves at once.
    pub fn departed(&self) -> impl Iterator<Item = &WorkerInfo> + '_ {
        let grace = self.departed_grace;
        self.departed.values().filter(move |(_, at)| at.elapsed() < grace).map(|(w, _)| w)
    }

    /// Every departed worker this view holds, with when its grace ends (already ended for
    /// some): for a caller that keeps a listing of [`Self::routable`] while the revision
    /// holds and judges each departed worker's grace at its own time.
    pub fn departed_until(&self) -> impl Iterator<Item = (&WorkerInfo, Instant)> + '_ {
        let grace = self.departed_grace;
        self.departed.values().map(move |(w, at)| (w, *at + grace))
    }

    /// The workers a router may consider: [`Self::workers`], then [`Self::departed`].
    ///
    /// A departed worker is one that may have lost only its lease, not its health (etcd
    /// expired it during an outage and it is re-registering); the router must still route
    /// only to workers that answer its health checks ready.
    pub fn routable(&self) -> impl Iterator<Item = &WorkerInfo> + '_ {
        self.workers().chain(self.departed())
    }

    /// How many workers are known.
    pub fn len(&self) -> usize {
        self.workers.len()
    }

    /// Whether no worker is known.
    pub fn is_empty(&self) -> bool {
        self.workers.is_empty()
    }

    /// One worker by role and id.
    pub fn get(&self, role: Role, id: &str) -> Option<&WorkerInfo> {
        self.workers.get(&(role, id.to_owned()))
    }

    /// Whether a worker with this role and id is known.
    pub fn contains(&self, role: Role, id: &str) -> bool {
        self.get(role, id).is_some()
    }

    /// The routable workers of one role in one version group: registered and not draining.
    pub fn select<'a>(&'a self, role: Role, version_group: &'a str) -> impl Iterator<Item = &'a WorkerInfo> + 'a {
        self.workers
            .range((role, String::new())..)
            .take_while(move |((r, _), _)| *r == role)
            .map(|(_, w)| w)
            .filter(move |w| w.version_group == version_group && !w.draining)
    }

    /// The version groups that have at least one routable prefill and one routable decode worker.
    pub fn ready_groups(&self) -> BTreeSet<&str> {
        let groups = |role| -> BTreeSet<&str> {
            self.workers.values().filter(|w| w.role == role && !w.draining).map(|w| w.version_group.as_str()).collect()
        };
        groups(Role::Prefill).intersection(&groups(Role::Decode)).copied().collect()
    }

    /// The etcd revision this view reflects.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// Whether a watch is established and following etcd (as of the last contact).
    pub fn is_live(&self) -> bool {
        self.live
    }

    /// When etcd last confirmed this view (a list, a watch event or a progress answer).
    pub fn last_contact(&self) -> Option<Instant> {
        self.last_contact
    }

    /// Time since etcd last confirmed this view; `None` before the first list.
    pub fn sync_age(&self) -> Option<Duration> {
        self.last_contact.map(|t| t.elapsed())
    }

    /// How many full lists have been loaded (1 after start-up; more after watch failures).
    pub fn resyncs(&self) -> u64 {
        self.resyncs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Capacity, TransferEndpoint};

    fn worker(role: Role, id: &str, group: &str, draining: bool) -> WorkerInfo {
        WorkerInfo {
            id: id.into(),
            role,
            version_group: group.into(),
            layout_fingerprint: "00".into(),
            grpc_addr: "127.0.0.1:1".into(),
            transfer: (role == Role::Decode).then(|| TransferEndpoint {
                addr: "127.0.0.1:2".into(),
                transport: "tcp".into(),
                cert_sha256: None,
            }),
            metrics_addr: None,
            capacity: Capacity::default(),
            draining,
            started_at_unix_ms: 0,
            determinism_fingerprint: String::new(),
            zone: String::new(),
        }
    }

    fn view(workers: Vec<WorkerInfo>) -> MembershipView {
        let map = workers.into_iter().map(|w| ((w.role, w.id.clone()), w)).collect();
        MembershipView { workers: Arc::new(map), ..MembershipView::empty() }
    }

    #[test]
    fn select_by_role_and_group_skips_draining() {
        let v = view(vec![
            worker(Role::Prefill, "p0", "a", false),
            worker(Role::Prefill, "p1", "b", false),
            worker(Role::Prefill, "p2", "a", true),
            worker(Role::Decode, "d0", "a", false),
            worker(Role::Decode, "d1", "b", true),
        ]);
        let ids = |role, group| v.select(role, group).map(|w| w.id.as_str()).collect::<Vec<_>>();
        assert_eq!(ids(Role::Prefill, "a"), ["p0"]);
        assert_eq!(ids(Role::Prefill, "b"), ["p1"]);
        assert_eq!(ids(Role::Decode, "a"), ["d0"]);
        assert!(ids(Role::Decode, "b").is_empty());
        assert_eq!(v.ready_groups().into_iter().collect::<Vec<_>>(), ["a"]);
        assert!(v.contains(Role::Decode, "d1"));
        assert!(!v.contains(Role::Prefill, "d1"));
        assert_eq!(v.len(), 5);
    }

    #[test]
    fn departed_workers_stay_routable_for_the_grace_unless_draining_or_back() {
        let mut v = MembershipView { departed_grace: Duration::from_secs(10), ..view(vec![]) };
        let now = Instant::now();
        v.depart([worker(Role::Decode, "d0", "a", false), worker(Role::Decode, "d1", "a", true)], now);
        let ids = |v: &MembershipView| v.routable().map(|w| w.id.clone()).collect::<Vec<_>>();
        // A draining worker left on purpose: not kept.
        assert_eq!(ids(&v), ["d0"]);
        assert_eq!(v.len(), 0, "departed workers are not members");
        // Back in the registry: a member again, no longer departed.
        v.workers = Arc::new([((Role::Decode, "d0".to_owned()), worker(Role::Decode, "d0", "a", false))].into());
        v.depart([], now);
        assert_eq!(v.departed().count(), 0);
        assert_eq!(ids(&v), ["d0"]);
        // Past the grace: gone.
        v.workers = Arc::default();
        v.depart([worker(Role::Decode, "d0", "a", false)], now - Duration::from_secs(11));
        assert_eq!(v.departed().count(), 0);
        // No grace: nothing kept.
        v.departed_grace = Duration::ZERO;
        v.depart([worker(Role::Decode, "d0", "a", false)], now);
        assert_eq!(v.departed().count(), 0);
    }
}
