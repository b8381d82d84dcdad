//! Workers register themselves in a real etcd (started by the test on
//! loopback ports) with what coordinators need, and deregister on SIGTERM.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use std::time::Duration;

use common::{decode_worker, prefill_worker, within, Signal, TestResult, WAIT};
use opskit::etcd::Etcd;
use registry::{EtcdConfig, Membership, MembershipConfig, MembershipView, Role};

/// Waits until the membership view satisfies `ok`.
async fn until(m: &Membership, what: &str, ok: impl Fn(&MembershipView) -> bool) -> TestResult {
    let mut rx = m.subscribe();
    within(what, async {
        loop {
            if ok(&rx.borrow_and_update()) {
                return Ok::<_, String>(());
            }
            rx.changed().await.map_err(|_| "membership stopped".to_string())?;
        }
    })
    .await??;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_register_with_their_addresses_and_deregister_on_sigterm() -> TestResult {
    let etcd = Etcd::start().await?;
    let ep = etcd.endpoint();
    let m = Membership::start(MembershipConfig::new(EtcdConfig::new([ep.clone()]), "tandem-test")).await?;
    m.wait_synced(Duration::from_secs(30)).await?;
    let flags = ["--etcd", &ep, "--cluster-prefix", "tandem-test", "--lease-ttl-s", "2"];
    let mut p = prefill_worker("g1", &[&flags[..], &["--worker-id", "p1"]].concat())?;
    let mut dflags = flags.to_vec();
    dflags.extend(["--worker-id", "d1", "--kv-load-failure-policy", "fail"]);
    let mut d = decode_worker("g1", &dflags)?;

    let (pg, dg) = (p.addr("grpc")?.to_string(), d.addr("grpc")?.to_string());
    until(&m, "both workers registered", |v| v.contains(Role::Prefill, "p1") && v.contains(Role::Decode, "d1")).await?;
    let view = m.view();
    let dinfo = view.get(Role::Decode, "d1").ok_or("no d1")?;
    assert_eq!((dinfo.version_group.as_str(), dinfo.grpc_addr.as_str()), ("g1", dg.as_str()));
    let t = dinfo.transfer.as_ref().ok_or("decode registered no transfer endpoint")?;
    assert_eq!((t.transport.as_str(), t.addr.as_str()), ("tcp", d.addr("transfer")?.to_string().as_str()));
    assert_eq!(dinfo.capacity.kv_blocks_total, 256);
    assert_eq!(dinfo.layout_fingerprint.len(), 64, "{dinfo:?}");
    let pinfo = view.get(Role::Prefill, "p1").ok_or("no p1")?;
    assert_eq!(pinfo.grpc_addr, pg);
    assert_eq!(pinfo.layout_fingerprint, dinfo.layout_fingerprint, "same model and layout, same fingerprint");
    assert_eq!(view.select(Role::Decode, "g1").count(), 1);

    // SIGTERM: the entry goes (deregistered, not left to expire) and the worker exits 0.
    d.signal(Signal::Term)?;
    until(&m, "the decode worker deregistered", |v| !v.contains(Role::Decode, "d1")).await?;
    assert_eq!(d.wait_exit(WAIT).await?.code(), Some(0));
    p.signal(Signal::Term)?;
    until(&m, "the prefill worker deregistered", |v| !v.contains(Role::Prefill, "p1")).await?;
    assert_eq!(p.wait_exit(WAIT).await?.code(), Some(0));
    m.stop().await;
    drop(etcd);
    Ok(())
}

/// The next status a grpc.health.v1 `Watch` reports (bounded).
async fn next_status(
    watch: &mut tonic::Streaming<tonic_health::pb::HealthCheckResponse>,
) -> Result<Option<tonic_health::pb::health_check_response::ServingStatus>, String> {
    let r = within("the probe's next status", watch.message()).await.map_err(|e| e.to_string())?;
    let r = r.map_err(|e| e.to_string())?.ok_or("the Watch stream ended")?;
    Ok(tonic_health::pb::health_check_response::ServingStatus::try_from(r.status).ok())
}

/// The kubelet's view (`grpc:` readiness probe, grpc.health.v1 `Check` on the gRPC port):
/// SERVING while the worker takes work, NOT_SERVING while it is fenced (here: cut off from
/// its coordinators, no `Health` call for the silence after a first one), SERVING again
/// once a coordinator reaches it. Probes are not coordinators: they keep no fence away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grpc_health_probe_follows_the_fence() -> TestResult {
    use proto::worker::v1::decode_worker_client::DecodeWorkerClient;
    use proto::worker::v1::HealthRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    let d = decode_worker("g1", &["--kv-load-failure-policy", "fail", "--coordinator-silence-fence-ms", "300"])?;
    let url = format!("http://{}", d.addr("grpc")?);
    let channel = tonic::transport::Endpoint::from_shared(url)?.connect().await?;
    let mut probe = HealthClient::new(channel.clone());
    let mut worker = DecodeWorkerClient::new(channel);
    let status = |r: tonic_health::pb::HealthCheckResponse| ServingStatus::try_from(r.status).ok();
    let check = HealthCheckRequest { service: String::new() };
    assert_eq!(status(probe.check(check.clone()).await?.into_inner()), Some(ServingStatus::Serving));

    let mut watch = probe.watch(check.clone()).await?.into_inner();
    assert_eq!(next_status(&mut watch).await?, Some(ServingStatus::Serving), "Watch starts with the current status");

    // A coordinator calls once, then falls silent: fenced, and the probe says so.
    worker.health(HealthRequest::default()).await?;
    assert_eq!(next_status(&mut watch).await?, Some(ServingStatus::NotServing), "fenced after the silence");
    // A probe's Check is no coordinator's call: still fenced after it.
    assert_eq!(status(probe.check(check.clone()).await?.into_inner()), Some(ServingStatus::NotServing));
    // A coordinator reaches it again: unfenced, SERVING.
    worker.health(HealthRequest::default()).await?;
    assert_eq!(next_status(&mut watch).await?, Some(ServingStatus::Serving), "unfenced by a coordinator's call");
    Ok(())
}

/// A worker that starts while etcd is down (restarting, a blip) waits for it and
/// registers once it is back, rather than exiting at the first refused connect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_while_etcd_is_down_registers_once_it_is_back() -> TestResult {
    let mut etcd = Etcd::start().await?;
    let ep = etcd.endpoint();
    etcd.stop();
    let flags = ["--etcd", &ep, "--cluster-prefix", "tandem-late", "--lease-ttl-s", "2", "--worker-id", "d-late"];
    let mut d = decode_worker("g1", &[&flags[..], &["--kv-load-failure-policy", "fail"]].concat())?;
    let retrying = opskit::eventually("the worker says it retries its registration", WAIT, || {
        let tail = d.log_tail();
        async move { tail.contains("etcd unreachable at start") }
    });
    retrying.await?;
    assert!(d.exited().is_none(), "the worker waits for etcd instead of exiting");
    etcd.restart().await?;
    let m = Membership::start(MembershipConfig::new(EtcdConfig::new([ep.clone()]), "tandem-late")).await?;
    m.wait_synced(Duration::from_secs(30)).await?;
    until(&m, "the late worker registered", |v| v.contains(Role::Decode, "d-late")).await?;
    d.signal(Signal::Term)?;
    assert_eq!(d.wait_exit(WAIT).await?.code(), Some(0));
    m.stop().await;
    Ok(())
}
