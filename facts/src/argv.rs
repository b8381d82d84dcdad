//! A worker's command line, flag by flag: `tandem up` and the drills' clusters start
//! workers through this one builder, so a renamed flag is renamed once. The workers'
//! own tests parse what it builds with their real flag parsers.
//!
//! ```
//! use facts::argv::WorkerArgv;
//! let args = WorkerArgv::decode()
//!     .etcd("http://127.0.0.1:2379")
//!     .worker_id("decode-0")
//!     .kv_transport("tcp")
//!     .build();
//! assert_eq!(args[..2], ["--etcd", "http://127.0.0.1:2379"]);
//! ```

use std::marker::PhantomData;

use crate::cpus::CpuList;

/// Marks a prefill worker's command line.
#[derive(Debug, Clone, Copy)]
pub struct Prefill;
/// Marks a decode worker's command line (it has the KV receiver's flags too).
#[derive(Debug, Clone, Copy)]
pub struct Decode;

/// A worker's flags, in the order they were given.
#[derive(Debug, Clone)]
pub struct WorkerArgv<R> {
    args: Vec<String>,
    role: PhantomData<R>,
}

/// The prefill worker's binary name.
pub const PREFILL_BINARY: &str = "tandem-prefill-worker";
/// The decode worker's binary name.
pub const DECODE_BINARY: &str = "tandem-decode-worker";
/// The coordinator's binary name.
pub const COORDINATOR_BINARY: &str = "tandem-coordinator";

impl WorkerArgv<Prefill> {
    pub fn prefill() -> Self {
        Self { args: Vec::new(), role: PhantomData }
    }

    /// Its binary's file name.
    pub fn binary(&self) -> &'static str {
        PREFILL_BINARY
    }
}

impl WorkerArgv<Decode> {
    pub fn decode() -> Self {
        Self { args: Vec::new(), role: PhantomData }
    }

    /// Its binary's file name.
    pub fn binary(&self) -> &'static str {
        DECODE_BINARY
    }

    /// `--transfer`: where the KV receiver listens (a socket address; `@name` for the
    /// local transport's abstract socket).
    pub fn transfer(self, addr: &str) -> Self {
        self.flag("--transfer", addr)
    }

    /// `--advertise-transfer`: the KV address registered instead of the bound one (a proxy
    /// in front of it).
    pub fn advertise_transfer(self, addr: &str) -> Self {
        self.flag("--advertise-transfer", addr)
    }

    /// `--advertise-grpc`: the gRPC address registered instead of the bound one.
    pub fn advertise_grpc(self, addr: &str) -> Self {
        self.flag("--advertise-grpc", addr)
    }

    /// `--kv-transport`: `tcp`, `quic`, `local` or `ucx`.
    pub fn kv_transport(self, transport: &str) -> Self {
        self.flag("--kv-transport", transport)
    }

    /// `--kv-load-failure-policy`: `recompute`, `retry` or `fail`.
    pub fn kv_load_failure_policy(self, policy: &str) -> Self {
        self.flag("--kv-load-failure-policy", policy)
    }

    /// `--reservation-ttl-ms`: the lease a prefill worker has to deliver a reservation's KV.
    pub fn reservation_ttl_ms(self, ms: u64) -> Self {
        self.flag("--reservation-ttl-ms", &ms.to_string())
    }
}

impl<R> WorkerArgv<R> {
    fn flag(mut self, flag: &str, value: &str) -> Self {
        self.args.push(flag.to_owned());
        self.args.push(value.to_owned());
        self
    }

    /// `--model`: the GGUF file.
    pub fn model(self, path: &str) -> Self {
        self.flag("--model", path)
    }

    /// `--etcd`: the registry's endpoints, comma-separated.
    pub fn etcd(self, endpoints: &str) -> Self {
        self.flag("--etcd", endpoints)
    }

    /// `--cluster-prefix`: the registry key prefix every process of one cluster shares.
    pub fn cluster_prefix(self, prefix: &str) -> Self {
        self.flag("--cluster-prefix", prefix)
    }

    /// `--lease-ttl-s`: the worker's etcd lease TTL.
    pub fn lease_ttl_s(self, s: u64) -> Self {
        self.flag("--lease-ttl-s", &s.to_string())
    }

    /// `--version-group`: the group the worker registers in.
    pub fn version_group(self, group: &str) -> Self {
        self.flag("--version-group", group)
    }

    /// `--worker-id`: the name it registers under.
    pub fn worker_id(self, id: &str) -> Self {
        self.flag("--worker-id", id)
    }

    /// `--threads`: compute threads.
    pub fn threads(self, n: usize) -> Self {
        self.flag("--threads", &n.to_string())
    }

    /// `--kv-blocks`: KV pool size in blocks.
    pub fn kv_blocks(self, n: usize) -> Self {
        self.flag("--kv-blocks", &n.to_string())
    }

    /// `--shutdown-timeout-ms`: the drain grace on SIGTERM.
    pub fn shutdown_timeout_ms(self, ms: u64) -> Self {
        self.flag("--shutdown-timeout-ms", &ms.to_string())
    }

    /// `--grpc`: where the worker's gRPC service listens.
    pub fn grpc(self, addr: &str) -> Self {
        self.flag("--grpc", addr)
    }

    /// `--metrics`: where its Prometheus `/metrics` listens.
    pub fn metrics(self, addr: &str) -> Self {
        self.flag("--metrics", addr)
    }

    /// `--nice`: the process's nice level.
    pub fn nice(self, nice: i32) -> Self {
        self.flag("--nice", &nice.to_string())
    }

    /// `--cpus`: the CPUs it is pinned to.
    pub fn cpus(self, cpus: &CpuList) -> Self {
        self.flag("--cpus", &cpus.to_string())
    }

    /// Flags the builder has no method for, added as given.
    pub fn extra<S: AsRef<str>>(mut self, args: impl IntoIterator<Item = S>) -> Self {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// The command line (without the binary).
    pub fn build(self) -> Vec<String> {
        self.args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_come_out_in_order_with_their_values() {
        let cpus = CpuList::parse("0-1").expect("a list");
        let args = WorkerArgv::prefill().worker_id("prefill-0").threads(2).nice(19).cpus(&cpus).extra(["--x"]).build();
        assert_eq!(args, ["--worker-id", "prefill-0", "--threads", "2", "--nice", "19", "--cpus", "0-1", "--x"]);
        let d = WorkerArgv::decode();
        assert_eq!(d.binary(), DECODE_BINARY);
        assert_eq!(
            d.transfer("@sock").kv_transport("local").build(),
            ["--transfer", "@sock", "--kv-transport", "local"]
        );
    }
}
