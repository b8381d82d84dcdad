//! The prefill worker: serves `PrefillWorker` over gRPC, runs prompts
//! through the engine as prefill-only requests, and pushes every layer's KV
//! into the decode worker's reservation over kvtransfer.
//!
//! Owns: the `tandem-prefill-worker` binary, its config ([`PrefillConfig`]),
//! its gRPC service ([`service`]), the KV push, and its metrics ([`metrics`]).
//! What both workers share is in `worker-common`.
//!
//! Must not keep KV after a request: its blocks are released whether the
//! transfer succeeded or not, because the decode worker owns the request.

#![forbid(unsafe_code)]

pub mod metrics;
#[cfg(feature = "fault-injection")]
pub mod plant;
pub mod service;

use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

use worker_common::config::{millis, read_file, CommonConfig, CommonFlags, ConfigError};

/// `tandem-prefill-worker` flags (each also a `TANDEM_*` env var and a TOML key).
/// The version `--version` prints, naming the drill hooks when the binary has them (the
/// drills read it before they rely on one).
#[cfg(feature = "fault-injection")]
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (fault-injection)");
/// The version `--version` prints.
#[cfg(not(feature = "fault-injection"))]
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Debug, Default, Clone, Parser, Deserialize)]
#[command(name = "tandem-prefill-worker", about = "tandem prefill worker", version = VERSION)]
#[serde(default)]
pub struct PrefillFlags {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: CommonFlags,
    /// KV transfer timeout (connect, each frame, Ack), ms. Env: TANDEM_TRANSFER_TIMEOUT_MS. Default 10000.
    #[arg(long, env = "TANDEM_TRANSFER_TIMEOUT_MS")]
    pub transfer_timeout_ms: Option<u64>,
    /// tcp only: keep the KV pool in mapped memory and write the frames of a prompt's
    /// last step straight from its blocks (each layer's checksums taken on the engine
    /// thread as it is computed, no copy into a buffer); earlier steps, which preemption
    /// could free, and `false`: each layer is gathered into a buffer on the engine thread
    /// and sent from there. Env: TANDEM_TCP_PINNED. Default true.
    #[arg(long, env = "TANDEM_TCP_PINNED")]
    pub tcp_pinned: Option<bool>,
    /// Drills only: flip one byte of the first frame (ucx: put) of each of the
    /// next N KV transfers, on any transport, after its checksum is taken, so
    /// the decode worker refuses it by checksum (a one-sided put has no link a
    /// fault proxy can sit in).
    /// Logged as a warning at start and counted in
    /// `tandem_faults_injected_total{fault="kv_corrupt"}`. Env:
    /// TANDEM_FAULT_KV_CORRUPT. Default 0 (off). Only in a binary built with the
    /// `fault-injection` feature.
    #[cfg(feature = "fault-injection")]
    #[arg(long, env = "TANDEM_FAULT_KV_CORRUPT")]
    pub fault_kv_corrupt: Option<u64>,
    /// Drills only, a planted bug: the N-th prefill this worker starts answers with
    /// another first token (HTTP 200 with a wrong answer), for a chaos run to catch.
    /// Env: TANDEM_FAULT_SWAP_TOKEN. Default 0 (off). Only with `fault-injection`.
    #[cfg(feature = "fault-injection")]
    #[arg(long, env = "TANDEM_FAULT_SWAP_TOKEN")]
    pub fault_swap_token: Option<u64>,
    /// Drills only, a planted bug: the N-th prefill this worker starts never releases
    /// its KV blocks (a leak), for a chaos run to catch. Env: TANDEM_FAULT_LEAK_BLOCKS.
    /// Default 0 (off). Only with `fault-injection`.
    #[cfg(feature = "fault-injection")]
    #[arg(long, env = "TANDEM_FAULT_LEAK_BLOCKS")]
    pub fault_leak_blocks: Option<u64>,
}

/// The validated prefill worker config.
#[derive(Debug, Clone, PartialEq)]
pub struct PrefillConfig {
    pub common: CommonConfig,
    pub transfer_timeout: Duration,
    /// tcp: frames written straight from the pool ([`PrefillFlags::tcp_pinned`]).
    pub tcp_pinned: bool,
    /// ucx KV transfers to corrupt after their checksum (drills; 0 = off).
    #[cfg(feature = "fault-injection")]
    pub fault_kv_corrupt: u64,
    /// The prefill whose first token is swapped, and the one whose blocks leak (planted
    /// bugs; 0 = off).
    #[cfg(feature = "fault-injection")]
    pub fault_swap_token: u64,
    #[cfg(feature = "fault-injection")]
    pub fault_leak_blocks: u64,
}

impl PrefillConfig {
    /// Defaults < the `--config` file < env and flags (already in `flags`).
    pub fn load(flags: &PrefillFlags) -> Result<Self, ConfigError> {
        let mut merged = match &flags.common.config {
            Some(path) => read_file::<PrefillFlags>(path)?,
            None => PrefillFlags::default(),
        };
        merged.common.overlay(&flags.common);
        worker_common::overlay!(merged, flags, transfer_timeout_ms, tcp_pinned);
        #[cfg(feature = "fault-injection")]
        worker_common::overlay!(merged, flags, fault_kv_corrupt, fault_swap_token, fault_leak_blocks);
        Self::resolve(&merged)
    }

    pub fn resolve(f: &PrefillFlags) -> Result<Self, ConfigError> {
        Ok(Self {
            common: f.common.resolve()?,
            transfer_timeout: millis("transfer_timeout_ms", f.transfer_timeout_ms, 10_000)?,
            tcp_pinned: f.tcp_pinned.unwrap_or(true),
            #[cfg(feature = "fault-injection")]
            fault_kv_corrupt: f.fault_kv_corrupt.unwrap_or(0),
            #[cfg(feature = "fault-injection")]
            fault_swap_token: f.fault_swap_token.unwrap_or(0),
            #[cfg(feature = "fault-injection")]
            fault_leak_blocks: f.fault_leak_blocks.unwrap_or(0),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use worker_common::config::fixtures::{common, some_file};

    /// The command line `tandem up` and the drills build is one this worker's parser takes,
    /// flag for flag.
    #[test]
    fn the_shared_argv_builder_speaks_this_workers_flags() {
        let cpus = facts::cpus::CpuList::parse("0").expect("a list");
        let argv = facts::argv::WorkerArgv::prefill()
            .model("/m.gguf")
            .etcd("http://127.0.0.1:2379")
            .cluster_prefix("p")
            .lease_ttl_s(3)
            .version_group("g")
            .worker_id("prefill-0")
            .threads(2)
            .kv_blocks(64)
            .shutdown_timeout_ms(500)
            .grpc("127.0.0.1:0")
            .metrics("127.0.0.1:1")
            .nice(19)
            .cpus(&cpus);
        assert_eq!(argv.binary(), <PrefillFlags as clap::CommandFactory>::command().get_name());
        let f = PrefillFlags::try_parse_from(std::iter::once("w".to_owned()).chain(argv.build())).expect("parses");
        let c = &f.common;
        assert_eq!(c.model.as_deref(), Some(std::path::Path::new("/m.gguf")));
        assert_eq!((c.etcd.as_deref(), c.cluster_prefix.as_deref()), (Some("http://127.0.0.1:2379"), Some("p")));
        assert_eq!(
            (c.lease_ttl_s, c.version_group.as_deref(), c.worker_id.as_deref()),
            (Some(3), Some("g"), Some("prefill-0"))
        );
        assert_eq!((c.threads, c.kv_blocks, c.shutdown_timeout_ms), (Some(2), Some(64), Some(500)));
        assert_eq!((c.grpc.as_deref(), c.metrics.as_deref()), (Some("127.0.0.1:0"), Some("127.0.0.1:1")));
        assert_eq!((c.nice, c.cpus.as_deref()), (Some(19), Some("0")));
    }

    #[test]
    fn zero_transfer_timeout_is_named() {
        let f = PrefillFlags { common: common(Some("g")), transfer_timeout_ms: Some(0), ..PrefillFlags::default() };
        let err = PrefillConfig::resolve(&f).err().map(|e| e.to_string());
        assert!(err.as_deref().is_some_and(|e| e.contains("`transfer_timeout_ms`")), "{err:?}");
    }

    #[test]
    fn file_then_flags_override_defaults() {
        let dir = std::env::temp_dir().join(format!("tandem-pw-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok();
        let path = dir.join("c.toml");
        let text = format!(
            "version_group = \"file-g\"\nkv_blocks = 7\nmax_waiting = 3\nmetrics = \"127.0.0.1:9464\"\n\
             transfer_timeout_ms = 250\ntcp_pinned = false\nmodel = {:?}\n",
            some_file()
        );
        std::fs::write(&path, text).ok();
        let mut flags = PrefillFlags::default();
        flags.common.config = Some(path.clone());
        flags.common.kv_blocks = Some(9);
        let cfg = match PrefillConfig::load(&flags) {
            Ok(c) => c,
            Err(e) => panic!("config did not load: {e}"),
        };
        assert_eq!((cfg.common.kv_blocks, cfg.common.max_waiting, cfg.common.kv_block_size), (9, 3, 16));
        assert_eq!(cfg.common.version_group.as_str(), "file-g");
        assert_eq!(cfg.common.metrics, std::net::SocketAddr::from(([127, 0, 0, 1], 9464)));
        assert_eq!(cfg.transfer_timeout, Duration::from_millis(250));
        assert!(!cfg.tcp_pinned, "the file turns pinned sends off");
        #[cfg(feature = "fault-injection")]
        assert_eq!(cfg.fault_kv_corrupt, 0, "the corruption fault is off unless asked for");
        std::fs::write(&path, "kv_blokcs = 1\n").ok();
        flags.common.config = Some(path);
        let err = PrefillConfig::load(&flags).err().map(|e| e.to_string());
        assert!(err.as_deref().is_some_and(|e| e.contains("unknown field `kv_blokcs`")), "{err:?}");
    }
}

#[cfg(test)]
mod shipped_config {
    use super::*;

    /// The shipped config parses.
    #[test]
    fn shipped_config_loads() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/prefill-worker.toml");
        let p = read_file::<PrefillFlags>(&path).map_err(|e| e.to_string());
        let p = p.and_then(|mut f| {
            f.common.model = Some(worker_common::config::fixtures::some_file());
            PrefillConfig::resolve(&f).map_err(|e| e.to_string())
        });
        assert!(p.is_ok(), "{p:?}");
    }
}
