//! etcd outages: the cache keeps serving and recovers; registrations fence and re-register.

mod common;

use std::time::Duration;

use common::*;
use registry::{Fence, FenceReason, Membership, Registration, RegistryError, Role};

#[tokio::test]
async fn etcd_restart_fences_workers_and_the_cache_recovers() {
    let mut etcd = etcd().await;
    let members = Membership::start(membership_config(&etcd)).await.expect("membership");
    let mut view = members.subscribe();
    let d0 = Registration::register(registration_config(&etcd, 1), worker(Role::Decode, "d0", "g1"))
        .await
        .expect("register d0");
    let p0 = Registration::register(registration_config(&etcd, 1), worker(Role::Prefill, "p0", "g1"))
        .await
        .expect("register p0");
    let before = wait_view(&mut view, Duration::from_secs(5), "both workers appearing", |v| v.len() == 2).await;
    let old_lease = d0.current().lease_id().expect("serving");
    let mut fence = d0.fence();
    let mut p0_fence = p0.fence();

    let pid = etcd.pid().expect("etcd running");
    etcd.stop();
    assert!(etcd.pid().is_none(), "etcd {pid} still tracked as running");

    // Within the 1 s TTL (plus slack) both workers stop taking work.
    let limit = Duration::from_secs(3);
    let fenced = wait_fence(&mut fence, limit, "d0 fencing while etcd is down", |f| !f.is_serving()).await;
    assert_eq!(fenced, Fence::Fenced { reason: FenceReason::Unreachable });
    wait_fence(&mut p0_fence, limit, "p0 fencing while etcd is down", |f| !f.is_serving()).await;
    // The cache notices and keeps serving what it had.
    let stale = wait_view(&mut view, limit, "membership noticing the outage", |v| !v.is_live()).await;
    assert_eq!(stale.len(), 2, "the cache dropped workers during the outage");
    assert!(!members.healthy());
    let age = members.last_sync_age().expect("synced once");
    assert!(age > Duration::ZERO);

    etcd.restart().await.expect("restarting etcd");

    let limit = Duration::from_secs(10);
    let serving = wait_fence(&mut fence, limit, "d0 re-registering after etcd came back", Fence::is_serving).await;
    let new_lease = serving.lease_id().expect("serving");
    assert_ne!(new_lease, old_lease, "re-registered without a fresh lease");
    wait_fence(&mut p0_fence, limit, "p0 re-registering", Fence::is_serving).await;
    let after = wait_view(&mut view, limit, "membership re-listing and going live", |v| {
        // The re-list can land before the workers rewrite their keys; the
        // watch then brings the re-registrations (a later revision).
        v.is_live() && v.resyncs() > before.resyncs() && v.len() == 2 && v.revision() > before.revision()
    })
    .await;
    assert!(after.revision() > before.revision(), "the cache did not read the re-registrations");
    assert_eq!(key_lease(&etcd, d0.key()).await, new_lease);
    // The old lease, which the restarted etcd extended, was revoked after the key moved.
    let old_ttl = client(&etcd).await.lease_time_to_live(old_lease, None).await.expect("ttl").ttl();
    assert!(old_ttl <= 0, "old lease still alive with {old_ttl} s");
    within(Duration::from_secs(5), "membership healthy again", async {
        while !members.healthy() {
            view.changed().await.expect("membership task alive");
        }
    })
    .await;
}

#[tokio::test]
async fn membership_started_during_an_outage_syncs_when_etcd_appears() {
    let mut etcd = etcd().await;
    etcd.stop();
    let members = Membership::start(membership_config(&etcd)).await.expect("membership");
    match members.wait_synced(Duration::from_millis(700)).await {
        Err(RegistryError::Timeout { .. }) => {}
        other => panic!("synced with etcd down: {other:?}"),
    }
    assert!(!members.healthy());
    assert_eq!(members.last_sync_age(), None);
    // Registering needs etcd: a bounded, retryable error, not a hang.
    let err = Registration::register(registration_config(&etcd, 1), worker(Role::Prefill, "p0", "g1"))
        .await
        .expect_err("registered with etcd down");
    assert!(err.is_retryable(), "{err}");

    etcd.restart().await.expect("restarting etcd");
    members.wait_synced(Duration::from_secs(10)).await.expect("first list after etcd came up");
    let mut view = members.subscribe();
    let _p0 = Registration::register(registration_config(&etcd, 1), worker(Role::Prefill, "p0", "g1"))
        .await
        .expect("register");
    wait_view(&mut view, Duration::from_secs(5), "p0 appearing", |v| v.contains(Role::Prefill, "p0")).await;
}

#[tokio::test]
async fn silent_etcd_fences_workers_and_the_cache_goes_stale_then_recovers() {
    let etcd = etcd().await;
    let upstream = etcd.endpoint().trim_start_matches("http://").to_owned();
    let proxy = proxy::FreezingProxy::start(upstream).await;
    let via_proxy = |mut config: registry::EtcdConfig| {
        config.endpoints = vec![proxy.endpoint()];
        config
    };
    let mut member_config = membership_config(&etcd);
    member_config.etcd = via_proxy(member_config.etcd);
    let mut reg_config = registration_config(&etcd, 1);
    reg_config.etcd = via_proxy(reg_config.etcd);

    let members = Membership::start(member_config).await.expect("membership");
    let mut view = members.subscribe();
    let reg = Registration::register(reg_config, worker(Role::Decode, "d0", "g1")).await.expect("register");
    let first = reg.current().lease_id().expect("serving");
    wait_view(&mut view, Duration::from_secs(5), "d0 appearing", |v| v.contains(Role::Decode, "d0")).await;
    let mut fence = reg.fence();

    // Connections stay open but nothing moves: no error, no reset, only silence.
    proxy.freeze(true);
    let limit = Duration::from_secs(3);
    let fenced = wait_fence(&mut fence, limit, "fencing while etcd is silent", |f| !f.is_serving()).await;
    assert_eq!(fenced, Fence::Fenced { reason: FenceReason::Unreachable });
    let stale = wait_view(&mut view, limit, "membership noticing the silent watch", |v| !v.is_live()).await;
    assert!(stale.contains(Role::Decode, "d0"), "the cache dropped d0 while etcd was silent");
    assert!(!members.healthy());

    proxy.freeze(false);
    let limit = Duration::from_secs(10);
    let serving = wait_fence(&mut fence, limit, "re-registering after the silence", Fence::is_serving).await;
    assert_ne!(serving.lease_id(), Some(first));
    wait_view(&mut view, limit, "membership live again with d0", |v| v.is_live() && v.contains(Role::Decode, "d0"))
        .await;
    assert_eq!(key_lease(&etcd, reg.key()).await, serving.lease_id().expect("serving"));
}
