//! etcd outages: the cache keeps serving and recovers; registrations serve on (static
//! stability), re-register without fencing when the key is free, and fence only when
//! another lease holds their key.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use std::time::Duration;

use common::*;
use opskit::etcd::Etcd;
use opskit::proxy::{Fault, Proxy};
use registry::{Fence, FenceReason, Membership, Registration, RegistryError, Role};

#[tokio::test]
async fn etcd_restart_fences_no_one_and_the_cache_recovers() {
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
    let d0_log = FenceLog::follow(d0.fence());
    let p0_log = FenceLog::follow(p0.fence());

    let pid = etcd.pid().expect("etcd running");
    etcd.stop();
    assert!(etcd.pid().is_none(), "etcd {pid} still tracked as running");

    // The cache notices and keeps serving what it had.
    let limit = Duration::from_secs(3);
    let stale = wait_view(&mut view, limit, "membership noticing the outage", |v| !v.is_live()).await;
    assert_eq!(stale.len(), 2, "the cache dropped workers during the outage");
    assert!(!members.healthy());
    let age = members.last_sync_age().expect("synced once");
    assert!(age > Duration::ZERO);
    // Three TTLs down: the workers serve on.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(d0.is_serving() && p0.is_serving(), "a worker left Serving while etcd was down");

    etcd.restart().await.expect("restarting etcd");

    let limit = Duration::from_secs(10);
    let after = wait_view(&mut view, limit, "membership re-listing and going live", |v| {
        v.is_live() && v.resyncs() > before.resyncs() && v.len() == 2
    })
    .await;
    assert_eq!(after.len(), 2);
    // A restarted etcd extends the leases it had, so the keys stayed under the old lease
    // (or, had it expired them, moved to a new one); either way the worker never fenced.
    let lease = d0.current().lease_id().expect("serving");
    assert_eq!(key_lease(&etcd, d0.key()).await, lease);
    if lease != old_lease {
        let old_ttl = client(&etcd).await.lease_time_to_live(old_lease, None).await.expect("ttl").ttl();
        assert!(old_ttl <= 0, "old lease still alive with {old_ttl} s");
    }
    d0_log.assert_always_serving("d0 through an etcd restart");
    p0_log.assert_always_serving("p0 through an etcd restart");
    opskit::within("membership healthy again", Duration::from_secs(5), async {
        while !members.healthy() {
            view.changed().await.expect("membership task alive");
        }
    })
    .await
    .expect("healthy");
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

/// A proxy in front of `etcd`, to freeze ([`Fault::Freeze`]: silent, connections kept open).
fn etcd_proxy(etcd: &Etcd) -> Proxy {
    let upstream = etcd.endpoint().trim_start_matches("http://").parse().expect("etcd's host:port");
    Proxy::start(upstream).expect("proxy")
}

/// d0 registered through a proxy (so its etcd link alone can go silent), and a
/// membership cache on etcd directly.
async fn via_proxy(etcd: &Etcd, ttl_secs: u64) -> (Proxy, Registration, Membership) {
    let proxy = etcd_proxy(etcd);
    let mut reg_config = registration_config(etcd, ttl_secs);
    reg_config.etcd.endpoints = vec![format!("http://{}", proxy.addr)];
    let members = Membership::start(membership_config(etcd)).await.expect("membership");
    let reg = Registration::register(reg_config, worker(Role::Decode, "d0", "g1")).await.expect("register");
    let mut view = members.subscribe();
    wait_view(&mut view, Duration::from_secs(5), "d0 appearing", |v| v.contains(Role::Decode, "d0")).await;
    (proxy, reg, members)
}

#[tokio::test]
async fn silent_etcd_past_the_ttl_fences_no_one_and_the_cache_goes_stale_then_recovers() {
    let etcd = etcd().await;
    let proxy = etcd_proxy(&etcd);
    let via_proxy = |mut config: registry::EtcdConfig| {
        config.endpoints = vec![format!("http://{}", proxy.addr)];
        config
    };
    let mut member_config = membership_config(&etcd);
    member_config.etcd = via_proxy(member_config.etcd);
    let mut reg_config = registration_config(&etcd, 1);
    reg_config.etcd = via_proxy(reg_config.etcd);

    let members = Membership::start(member_config).await.expect("membership");
    let mut view = members.subscribe();
    let reg = Registration::register(reg_config, worker(Role::Decode, "d0", "g1")).await.expect("register");
    wait_view(&mut view, Duration::from_secs(5), "d0 appearing", |v| v.contains(Role::Decode, "d0")).await;
    let log = FenceLog::follow(reg.fence());

    // Connections stay open but nothing moves: no error, no reset, only silence.
    proxy.arm(Fault::Freeze);
    let limit = Duration::from_secs(3);
    let stale = wait_view(&mut view, limit, "membership noticing the silent watch", |v| !v.is_live()).await;
    assert!(stale.contains(Role::Decode, "d0"), "the cache dropped d0 while etcd was silent");
    assert!(!members.healthy());
    // Three TTLs of silence (etcd has expired the lease by now): still serving.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(reg.is_serving(), "fenced while etcd was only unreachable: {:?}", reg.current());

    proxy.arm(Fault::None);
    let limit = Duration::from_secs(10);
    wait_view(&mut view, limit, "membership live again with d0", |v| v.is_live() && v.contains(Role::Decode, "d0"))
        .await;
    opskit::eventually("d0's key under its current lease", limit, || async {
        key_lease(&etcd, reg.key()).await == reg.current().lease_id().unwrap_or(-1)
    })
    .await
    .expect("d0's key");
    log.assert_always_serving("d0 through a silent etcd");
}

#[tokio::test]
async fn lease_expired_with_the_key_free_reregisters_without_fencing_and_stays_routable() {
    let etcd = etcd().await;
    let (proxy, reg, members) = via_proxy(&etcd, 1).await;
    let mut view = members.subscribe();
    let first = reg.current().lease_id().expect("serving");
    let log = FenceLog::follow(reg.fence());

    // d0 alone is cut off; etcd runs on and expires its lease, deleting the key.
    proxy.arm(Fault::Freeze);
    let limit = Duration::from_secs(5);
    let gone = wait_view(&mut view, limit, "d0's key expiring", |v| !v.contains(Role::Decode, "d0")).await;
    // The cache keeps it as departed: routable while it answers health checks.
    assert!(gone.departed().any(|w| w.id == "d0"), "d0 not kept as departed");
    assert!(gone.routable().any(|w| w.id == "d0"), "d0 not routable during its grace");
    assert!(reg.is_serving(), "fenced while only etcd was unreachable: {:?}", reg.current());

    // Back: etcd says TTL 0; the key is free, so d0 claims it under a new lease, serving throughout.
    proxy.arm(Fault::None);
    let back =
        wait_view(&mut view, Duration::from_secs(10), "d0 re-registered", |v| v.contains(Role::Decode, "d0")).await;
    assert_eq!(back.departed().count(), 0, "d0 still departed after coming back");
    let mut fence = reg.fence();
    let lease = wait_fence(&mut fence, Duration::from_secs(5), "d0 serving under a new lease", |f| {
        f.lease_id().is_some_and(|l| l != first)
    })
    .await
    .lease_id()
    .expect("serving");
    assert_eq!(key_lease(&etcd, reg.key()).await, lease);
    log.assert_always_serving("d0 whose lease expired while cut off");
}

#[tokio::test]
async fn key_taken_by_another_lease_fences_until_it_is_free() {
    let etcd = etcd().await;
    let (proxy, reg, members) = via_proxy(&etcd, 1).await;
    let mut view = members.subscribe();
    let mut fence = reg.fence();

    proxy.arm(Fault::Freeze);
    wait_view(&mut view, Duration::from_secs(5), "d0's key expiring", |v| !v.contains(Role::Decode, "d0")).await;
    // Another process registers the same id meanwhile.
    let mut c = client(&etcd).await;
    let other = c.lease_grant(30, None).await.expect("grant").id();
    let value = serde_json::to_vec(&worker(Role::Decode, "d0", "g1")).expect("json");
    c.put(reg.key(), value, Some(etcd_client::PutOptions::new().with_lease(other))).await.expect("put");

    proxy.arm(Fault::None);
    let fenced = wait_fence(&mut fence, Duration::from_secs(10), "d0 fencing: its key is held by another lease", |f| {
        !f.is_serving()
    })
    .await;
    assert_eq!(fenced, Fence::Fenced { reason: FenceReason::KeyTaken { lease: other } });
    assert_eq!(key_lease(&etcd, reg.key()).await, other, "d0 took a key another lease holds");

    // The other holder goes: d0 claims its key and serves again.
    c.lease_revoke(other).await.expect("revoke");
    let serving =
        wait_fence(&mut fence, Duration::from_secs(10), "d0 serving once its key is free", Fence::is_serving).await;
    assert_eq!(key_lease(&etcd, reg.key()).await, serving.lease_id().expect("serving"));
}
