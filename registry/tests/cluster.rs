//! A three-member etcd (`opskit::etcd::EtcdCluster`): the leader's death is invisible to registrations and the
//! membership cache; losing quorum fences no worker (static stability) but makes the cache unhealthy (while it
//! stays readable), and restoring quorum brings both back.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use std::time::Duration;

use common::*;
use opskit::etcd::EtcdCluster;
use opskit::eventually;
use registry::{EtcdConfig, Membership, MembershipConfig, Registration, RegistrationConfig, Role};

fn cluster_config(etcd: &EtcdCluster) -> EtcdConfig {
    let mut config = EtcdConfig::new(etcd.endpoints());
    config.connect_timeout = Duration::from_millis(500);
    config.request_timeout = Duration::from_millis(500);
    config
}

async fn wait_leader(etcd: &EtcdCluster, limit: Duration) -> usize {
    opskit::poll("a member reporting itself leader", limit, || async {
        Ok::<_, std::convert::Infallible>(etcd.leader().await)
    })
    .await
    .expect("a leader")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_failover_and_quorum_loss() {
    let _ = etcd().await; // only for its tracing setup; the single member is dropped at once
    let mut etcd = EtcdCluster::start(3).await.expect("starting three etcd members");
    assert_eq!(etcd.endpoints().len(), 3);
    let leader = wait_leader(&etcd, Duration::from_secs(10)).await;

    let mut rc = RegistrationConfig::new(cluster_config(&etcd), PREFIX);
    rc.ttl = Duration::from_secs(2);
    rc.retry_min = Duration::from_millis(50);
    rc.retry_max = Duration::from_millis(500);
    rc.takeover_timeout = Duration::from_millis(500);
    let d0 = Registration::register(rc, worker(Role::Decode, "d0", "g1")).await.expect("register d0");
    // The cache watches the member that survives throughout: a member without quorum
    // could still answer its progress requests locally.
    let survivor = (0..3).find(|&i| i != leader).expect("a follower");
    let mut only_survivor = cluster_config(&etcd);
    only_survivor.endpoints = vec![etcd.endpoint(survivor)];
    let mut mc = MembershipConfig::new(only_survivor, PREFIX);
    mc.progress_interval = Duration::from_millis(250);
    mc.silence_timeout = Duration::from_secs(1);
    mc.retry_min = Duration::from_millis(50);
    mc.retry_max = Duration::from_millis(500);
    let members = Membership::start(mc).await.expect("membership");
    let mut view = members.subscribe();
    wait_view(&mut view, Duration::from_secs(5), "d0 appearing", |v| v.len() == 1).await;

    // The leader dies: another member takes over, and the worker ends up serving.
    let old = etcd.kill(leader).expect("the leader was running");
    let new = wait_leader(&etcd, Duration::from_secs(10)).await;
    assert_ne!(new, leader, "killed member {leader} (pid {old}) still reported as leader");
    let mut fence = d0.fence();
    wait_fence(&mut fence, Duration::from_secs(10), "d0 serving after failover", |f| f.is_serving()).await;
    eventually("the cache healthy after failover", Duration::from_secs(10), || async { members.healthy() })
        .await
        .expect("healthy");

    // A second member dies: no quorum. The worker serves on (nothing answers that its lease
    // is gone); the cache stays readable but reports itself unhealthy, so a coordinator
    // stops trusting it after its bound.
    let second = (0..3).find(|&i| i != leader && i != survivor).expect("a third member");
    let log = FenceLog::follow(d0.fence());
    etcd.kill(second);
    eventually("the cache unhealthy without quorum", Duration::from_secs(10), || async { !members.healthy() })
        .await
        .expect("unhealthy");
    assert_eq!(members.view().len(), 1, "the cached view stays readable");
    // Past the 2 s TTL without quorum: still serving.
    tokio::time::sleep(Duration::from_secs(3)).await;
    log.assert_always_serving("d0 without quorum");

    // Quorum back: the worker re-registers and the cache is healthy again.
    etcd.restart(second).await.expect("restarting a member");
    wait_fence(&mut fence, Duration::from_secs(15), "d0 serving after quorum returns", |f| f.is_serving()).await;
    eventually("the cache healthy after quorum returns", Duration::from_secs(15), || async { members.healthy() })
        .await
        .expect("healthy");
    wait_view(&mut view, Duration::from_secs(10), "d0 listed after quorum returns", |v| v.len() == 1).await;
}
