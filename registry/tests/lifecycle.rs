//! Registration and membership on a live etcd: register, keep alive, drain, deregister,
//! expire, duplicate ids, lease loss, compaction, and two caches agreeing.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use std::time::Duration;

use common::*;
use etcd_client::CompactionOptions;
use registry::{Fence, FenceReason, Membership, Registration, RegistryError, Role};

const SEEN: Duration = Duration::from_secs(5);

#[tokio::test]
async fn register_is_seen_and_deregister_removes_it() {
    let etcd = etcd().await;
    let members = Membership::start(membership_config(&etcd)).await.expect("membership");
    let mut view = members.subscribe();
    members.wait_synced(SEEN).await.expect("first list");

    let info = worker(Role::Decode, "d0", "g1");
    let reg = Registration::register(registration_config(&etcd, 2), info.clone()).await.expect("register");
    assert_eq!(reg.key(), "/tandem-test/workers/decode/d0");
    assert!(reg.is_serving());
    let v = wait_view(&mut view, SEEN, "d0 appearing in membership", |v| v.contains(Role::Decode, "d0")).await;
    assert_eq!(v.get(Role::Decode, "d0"), Some(&info));
    assert_eq!(members.select(Role::Decode, "g1"), std::slice::from_ref(&info));
    assert!(members.select(Role::Decode, "g2").is_empty());
    assert!(members.healthy());

    let mut fence = reg.fence();
    reg.deregister().await.expect("deregister");
    assert_eq!(*fence.borrow_and_update(), Fence::Stopped);
    wait_view(&mut view, SEEN, "d0 leaving membership after deregister", |v| v.is_empty()).await;
    assert_eq!(key_lease(&etcd, "/tandem-test/workers/decode/d0").await, 0, "key still in etcd");
}

#[tokio::test]
async fn keepalive_holds_past_several_ttls() {
    let etcd = etcd().await;
    let members = Membership::start(membership_config(&etcd)).await.expect("membership");
    let mut view = members.subscribe();
    let reg = Registration::register(registration_config(&etcd, 2), worker(Role::Prefill, "p0", "g1"))
        .await
        .expect("register");
    let lease = reg.current().lease_id().expect("serving");
    wait_view(&mut view, SEEN, "p0 appearing", |v| v.contains(Role::Prefill, "p0")).await;
    let resyncs = view.borrow().resyncs();

    // Three TTLs during which neither the fence nor the membership may change.
    let mut fence = reg.fence();
    fence.borrow_and_update();
    view.borrow_and_update();
    let quiet = tokio::time::timeout(Duration::from_millis(6500), async {
        tokio::select! {
            r = fence.changed() => format!("fence changed ({r:?}) to {:?}", *fence.borrow()),
            r = view.changed() => format!("membership changed ({r:?})"),
        }
    })
    .await;
    if let Ok(change) = quiet {
        panic!("over three TTLs nothing should change, but {change}");
    }
    assert_eq!(reg.current(), Fence::Serving { lease_id: lease });
    assert_eq!(key_lease(&etcd, reg.key()).await, lease, "key not under the original lease");
    let ttl = client(&etcd).await.lease_time_to_live(lease, None).await.expect("time to live").ttl();
    assert!(ttl > 0, "lease has {ttl} s left");
    // Progress answers kept the watch alive: no re-list, and the cache is fresh.
    assert_eq!(view.borrow().resyncs(), resyncs, "the watch was rebuilt while etcd was healthy");
    assert!(members.healthy(), "membership unhealthy; sync age {:?}", members.last_sync_age());
    assert!(members.last_sync_age().expect("synced") < Duration::from_secs(1));
}

#[tokio::test]
async fn abandoned_lease_expires_and_removes_worker() {
    let etcd = etcd().await;
    let members = Membership::start(membership_config(&etcd)).await.expect("membership");
    let mut view = members.subscribe();
    let reg = Registration::register(registration_config(&etcd, 1), worker(Role::Prefill, "p0", "g1"))
        .await
        .expect("register");
    wait_view(&mut view, SEEN, "p0 appearing", |v| v.contains(Role::Prefill, "p0")).await;
    reg.abandon().await;
    // TTL 1 s plus etcd's expiry sweep (500 ms) and slack.
    wait_view(&mut view, SEEN, "p0 leaving after its lease expired", |v| v.is_empty()).await;
}

#[tokio::test]
async fn draining_flag_propagates_under_the_same_lease() {
    let etcd = etcd().await;
    let members = Membership::start(membership_config(&etcd)).await.expect("membership");
    let mut view = members.subscribe();
    let reg = Registration::register(registration_config(&etcd, 2), worker(Role::Decode, "d0", "g1"))
        .await
        .expect("register");
    let lease = reg.current().lease_id().expect("serving");
    wait_view(&mut view, SEEN, "d0 appearing", |v| v.contains(Role::Decode, "d0")).await;

    reg.set_draining(true).await.expect("set draining");
    let v = wait_view(&mut view, SEEN, "d0 marked draining", |v| v.get(Role::Decode, "d0").is_some_and(|w| w.draining))
        .await;
    assert_eq!(v.select(Role::Decode, "g1").count(), 0, "a draining worker is still selectable");
    assert_eq!(key_lease(&etcd, reg.key()).await, lease);
    assert_eq!(reg.current(), Fence::Serving { lease_id: lease });

    reg.set_draining(false).await.expect("clear draining");
    wait_view(&mut view, SEEN, "d0 no longer draining", |v| v.select(Role::Decode, "g1").count() == 1).await;
}

#[tokio::test]
async fn duplicate_id_is_refused_until_the_holder_expires() {
    let etcd = etcd().await;
    let first = Registration::register(registration_config(&etcd, 1), worker(Role::Prefill, "p0", "g1"))
        .await
        .expect("register first");
    let held = first.current().lease_id().expect("serving");
    match Registration::register(registration_config(&etcd, 1), worker(Role::Prefill, "p0", "g2")).await {
        Err(RegistryError::KeyHeld { lease, .. }) => assert_eq!(lease, held),
        other => panic!("a second worker with the same id registered: {other:?}"),
    }
    assert!(first.is_serving(), "the refused duplicate disturbed the first registration");

    // A crashed holder (keepalive stopped, lease left to expire) is taken over once it expires.
    first.abandon().await;
    let mut config = registration_config(&etcd, 1);
    config.takeover_timeout = Duration::from_secs(5);
    let second = Registration::register(config, worker(Role::Prefill, "p0", "g2")).await.expect("take over");
    let lease = second.current().lease_id().expect("serving");
    assert_ne!(lease, held);
    assert_eq!(key_lease(&etcd, second.key()).await, lease);
}

#[tokio::test]
async fn lost_lease_and_lost_key_reregister_without_fencing() {
    let etcd = etcd().await;
    let members = Membership::start(membership_config(&etcd)).await.expect("membership");
    let mut view = members.subscribe();
    let reg = Registration::register(registration_config(&etcd, 2), worker(Role::Decode, "d0", "g1"))
        .await
        .expect("register");
    let mut fence = reg.fence();
    let log = FenceLog::follow(reg.fence());
    let first = reg.current().lease_id().expect("serving");
    let mut etcd_client = client(&etcd).await;

    // Someone revokes the lease: the next keepalive answer says TTL 0, and the key is free.
    etcd_client.lease_revoke(first).await.expect("revoke");
    let second =
        wait_fence(&mut fence, SEEN, "re-registering with a new lease", |f| f.lease_id().is_some_and(|l| l != first))
            .await
            .lease_id()
            .expect("serving");
    wait_view(&mut view, SEEN, "d0 back in membership", |v| v.contains(Role::Decode, "d0")).await;
    assert_eq!(key_lease(&etcd, reg.key()).await, second);

    // Someone deletes the key: the next write notices and claims it again with the new value.
    etcd_client.delete(reg.key(), None).await.expect("delete");
    reg.set_draining(true).await.expect("set draining");
    wait_view(&mut view, SEEN, "d0 back and draining", |v| v.get(Role::Decode, "d0").is_some_and(|w| w.draining)).await;
    assert!(reg.is_serving());
    log.assert_always_serving("d0 whose lease was revoked and key deleted");
    // FenceReason is only for a key held by another lease (see outage.rs).
    let _ = FenceReason::KeyTaken { lease: 0 };
}

#[tokio::test]
async fn compaction_does_not_break_the_watch() {
    let etcd = etcd().await;
    let members = Membership::start(membership_config(&etcd)).await.expect("membership");
    let mut view = members.subscribe();
    let _p0 = Registration::register(registration_config(&etcd, 2), worker(Role::Prefill, "p0", "g1"))
        .await
        .expect("register p0");
    let v = wait_view(&mut view, SEEN, "p0 appearing", |v| v.contains(Role::Prefill, "p0")).await;

    let mut c = client(&etcd).await;
    for i in 0..5 {
        c.put(format!("/tandem-test/other/{i}"), "x", None).await.expect("put");
    }
    let revision = c.get("/", None).await.expect("get").header().expect("header").revision();
    c.compact(revision, Some(CompactionOptions::new().with_physical())).await.expect("compact");

    let _d0 = Registration::register(registration_config(&etcd, 2), worker(Role::Decode, "d0", "g1"))
        .await
        .expect("register d0");
    let after = wait_view(&mut view, SEEN, "d0 appearing after compaction", |v| v.contains(Role::Decode, "d0")).await;
    assert!(after.revision() > revision);
    assert_eq!(after.ready_groups().into_iter().collect::<Vec<_>>(), ["g1"]);
    assert_eq!(after.resyncs(), v.resyncs(), "compaction at the current revision should not force a re-list");
}

#[tokio::test]
async fn two_memberships_see_the_same_set() {
    let etcd = etcd().await;
    let mut c = client(&etcd).await;
    // Values a cache must ignore: a foreign key layout, garbage, and a key/value mismatch.
    c.put("/tandem-test/workers/router/r0", "{}", None).await.expect("put");
    c.put("/tandem-test/workers/decode/bogus", "not json", None).await.expect("put");
    let mismatched = serde_json::to_string(&worker(Role::Decode, "d9", "g1")).expect("json");
    c.put("/tandem-test/workers/decode/d8", mismatched, None).await.expect("put");

    let a = Membership::start(membership_config(&etcd)).await.expect("membership a");
    let mut regs = Vec::new();
    for (role, id, group) in [(Role::Prefill, "p0", "g1"), (Role::Prefill, "p1", "g2"), (Role::Decode, "d0", "g1")] {
        let reg =
            Registration::register(registration_config(&etcd, 2), worker(role, id, group)).await.expect("register");
        regs.push(reg);
    }
    // b starts after the registrations, so it lists them (over two pages of 2) instead of watching.
    let b = Membership::start(membership_config(&etcd)).await.expect("membership b");
    let ids = |v: &registry::MembershipView| v.workers().map(|w| (w.role, w.id.clone())).collect::<Vec<_>>();
    let (mut va, mut vb) = (a.subscribe(), b.subscribe());
    let seen_a = wait_view(&mut va, SEEN, "a seeing three workers", |v| v.len() == 3).await;
    let seen_b = wait_view(&mut vb, SEEN, "b seeing three workers", |v| v.len() == 3).await;
    assert_eq!(ids(&seen_a), ids(&seen_b));
    assert_eq!(seen_a.workers().collect::<Vec<_>>(), seen_b.workers().collect::<Vec<_>>());

    let p1 = regs.remove(1);
    p1.deregister().await.expect("deregister p1");
    let seen_a = wait_view(&mut va, SEEN, "a seeing p1 leave", |v| v.len() == 2).await;
    let seen_b = wait_view(&mut vb, SEEN, "b seeing p1 leave", |v| v.len() == 2).await;
    assert_eq!(ids(&seen_a), ids(&seen_b));
    assert_eq!(ids(&seen_a), [(Role::Prefill, "p0".to_owned()), (Role::Decode, "d0".to_owned())]);
}
