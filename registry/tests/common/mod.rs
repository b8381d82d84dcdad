//! What the registry tests share beyond opskit: configs with short timings, worker values,
//! and waits on the registry's own watch channels whose panics say what did not happen.

#![allow(dead_code)]

use std::time::Duration;

use opskit::etcd::Etcd;
use registry::{
    Capacity, EtcdConfig, Fence, MembershipConfig, MembershipView, RegistrationConfig, Role, TransferEndpoint,
    WorkerInfo,
};
use tokio::sync::watch;

pub const PREFIX: &str = "tandem-test";

/// Starts a test etcd. Also routes `tracing` to the test output, filtered by `RUST_LOG`.
pub async fn etcd() -> Etcd {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    Etcd::start().await.expect("starting a test etcd")
}

pub fn etcd_config(etcd: &Etcd) -> EtcdConfig {
    let mut config = EtcdConfig::new(etcd.endpoints());
    config.connect_timeout = Duration::from_millis(500);
    config.request_timeout = Duration::from_millis(500);
    config
}

pub fn registration_config(etcd: &Etcd, ttl_secs: u64) -> RegistrationConfig {
    let mut config = RegistrationConfig::new(etcd_config(etcd), PREFIX);
    config.ttl = Duration::from_secs(ttl_secs);
    config.retry_min = Duration::from_millis(50);
    config.retry_max = Duration::from_millis(500);
    config.takeover_timeout = Duration::from_millis(500);
    config
}

pub fn membership_config(etcd: &Etcd) -> MembershipConfig {
    let mut config = MembershipConfig::new(etcd_config(etcd), PREFIX);
    config.progress_interval = Duration::from_millis(250);
    config.silence_timeout = Duration::from_secs(1);
    config.retry_min = Duration::from_millis(50);
    config.retry_max = Duration::from_millis(500);
    config.page_size = 2;
    config
}

pub fn worker(role: Role, id: &str, group: &str) -> WorkerInfo {
    WorkerInfo {
        id: id.into(),
        role,
        version_group: group.into(),
        layout_fingerprint: "0123456789abcdef".into(),
        grpc_addr: format!("127.0.0.1:{}", 7000 + id.len()),
        transfer: (role == Role::Decode).then(|| TransferEndpoint {
            addr: "127.0.0.1:7100".into(),
            transport: "tcp".into(),
            cert_sha256: None,
        }),
        metrics_addr: Some("127.0.0.1:9100".into()),
        capacity: Capacity { kv_blocks_total: 1024, max_running: 8 },
        draining: false,
        started_at_unix_ms: WorkerInfo::unix_ms_now(),
        determinism_fingerprint: String::new(),
        zone: String::new(),
    }
}

/// Waits until the membership view satisfies `pred`.
pub async fn wait_view(
    rx: &mut watch::Receiver<MembershipView>,
    limit: Duration,
    what: &str,
    pred: impl FnMut(&MembershipView) -> bool,
) -> MembershipView {
    let waited = tokio::time::timeout(limit, rx.wait_for(pred)).await.map(|r| r.map(|v| v.clone()));
    match waited {
        Ok(Ok(v)) => v,
        Ok(Err(_)) => panic!("{what}: the membership task stopped"),
        Err(_) => {
            let v = rx.borrow().clone();
            let ids: Vec<_> = v.workers().map(|w| format!("{}/{}", w.role, w.id)).collect();
            panic!("within {limit:?}: {what} did not happen; view: live={} workers={ids:?}", v.is_live())
        }
    }
}

/// Waits until the fence satisfies `pred`.
pub async fn wait_fence(
    rx: &mut watch::Receiver<Fence>,
    limit: Duration,
    what: &str,
    pred: impl FnMut(&Fence) -> bool,
) -> Fence {
    let waited = tokio::time::timeout(limit, rx.wait_for(pred)).await.map(|r| r.map(|f| f.clone()));
    match waited {
        Ok(Ok(f)) => f,
        Ok(Err(_)) => panic!("{what}: the registration task stopped"),
        Err(_) => panic!("within {limit:?}: {what} did not happen; fence is {:?}", *rx.borrow()),
    }
}

/// The lease the key is attached to in etcd now (0 if absent).
pub async fn key_lease(etcd: &Etcd, key: &str) -> i64 {
    let mut client = etcd_client::Client::connect(etcd.endpoints(), None).await.expect("connect");
    let got =
        opskit::within("get", Duration::from_secs(2), client.get(key, None)).await.expect("bounded").expect("get");
    got.kvs().first().map_or(0, |kv| kv.lease())
}

pub async fn client(etcd: &Etcd) -> etcd_client::Client {
    etcd_client::Client::connect(etcd.endpoints(), None).await.expect("connect")
}

/// Every fence value a registration published, as seen by a task that follows its channel
/// (a flip back within one scheduling step could coalesce; the keeper holds `Fenced` at
/// least one retry delay, so it is seen).
pub struct FenceLog {
    seen: std::sync::Arc<std::sync::Mutex<Vec<Fence>>>,
    task: tokio::task::JoinHandle<()>,
}

impl FenceLog {
    pub fn follow(mut rx: watch::Receiver<Fence>) -> Self {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(vec![rx.borrow_and_update().clone()]));
        let log = seen.clone();
        let task = tokio::spawn(async move {
            while rx.changed().await.is_ok() {
                let f = rx.borrow_and_update().clone();
                log.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(f);
            }
        });
        Self { seen, task }
    }

    pub fn seen(&self) -> Vec<Fence> {
        self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// Panics if any value seen so far was not `Serving`.
    pub fn assert_always_serving(&self, what: &str) {
        let seen = self.seen();
        assert!(seen.iter().all(Fence::is_serving), "{what}: the fence left Serving: {seen:?}");
    }
}

impl Drop for FenceLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}
