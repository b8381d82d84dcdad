//! The decode worker: serves `DecodeWorker` over gRPC. A `Generate` either
//! prefills locally (short prompts, or no prefill worker named) or reserves
//! KV blocks under a lease, has a prefill worker fill them over kvtransfer,
//! and joins the sequence to the continuous-batching loop once every layer
//! arrived intact; if the remote KV does not arrive, the
//! [`KvLoadFailurePolicy`] decides what happens. See `service` for the walk.
//!
//! Owns: the `tandem-decode-worker` binary, its config ([`DecodeConfig`]),
//! its gRPC service, the KV receive path into the engine's pool ([`sink`]),
//! the policy, the absorbed-prefill budget ([`absorb`]) and its metrics
//! ([`metrics`]). What both workers share is in `worker-common`.
//!
//! Must not: queue beyond a small bounded buffer, or hand a reservation's
//! blocks to the engine before every layer arrived intact.

#![forbid(unsafe_code)]

pub mod absorb;
pub mod metrics;
pub mod service;
pub mod sink;

use std::fmt;
use std::time::Duration;

use clap::Parser;
use serde::Deserialize;

use worker_common::config::{
    invalid, millis, positive, read_file, socket_addr, CommonConfig, CommonFlags, ConfigError,
};

/// What the decode worker does when remote KV does not arrive intact
/// (prefill worker dead or erroring, transfer refused, corrupt frame,
/// reservation lease expired, handshake refused).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvLoadFailurePolicy {
    /// Prefill the prompt on the decode worker itself: same output, more
    /// decode-side compute.
    Recompute,
    /// Try the next prefill worker the request names, within the deadline
    /// and `max_prefill_attempts`; `kv_load_failed` when they run out.
    Retry,
    /// Answer `kv_load_failed` (`version_mismatch` for a handshake refusal).
    Fail,
}

impl KvLoadFailurePolicy {
    pub const ALL: [Self; 3] = [Self::Recompute, Self::Retry, Self::Fail];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Recompute => "recompute",
            Self::Retry => "retry",
            Self::Fail => "fail",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == s)
    }

    /// The per-request override from the wire; `None` when unset.
    pub fn from_wire(p: proto::worker::v1::KvLoadFailurePolicy) -> Option<Self> {
        use proto::worker::v1::KvLoadFailurePolicy as W;
        match p {
            W::Unspecified => None,
            W::Recompute => Some(Self::Recompute),
            W::Retry => Some(Self::Retry),
            W::Fail => Some(Self::Fail),
        }
    }
}

impl fmt::Display for KvLoadFailurePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The default of [`DecodeFlags::max_absorbed_prefill_tokens_per_s`]: one
/// default engine step's token budget (`max_batch_tokens`) per second.
pub const DEFAULT_MAX_ABSORBED_PREFILL_TOKENS_PER_S: u64 = 512;

/// `tandem-decode-worker` flags (each also a `TANDEM_*` env var and a TOML key).
#[derive(Debug, Default, Clone, Parser, Deserialize)]
#[command(name = "tandem-decode-worker", about = "tandem decode worker", version)]
#[serde(default)]
pub struct DecodeFlags {
    #[command(flatten)]
    #[serde(flatten)]
    pub common: CommonFlags,
    /// Required: recompute | retry | fail. What to do when remote KV does
    /// not arrive intact; a request may override it. Env: TANDEM_KV_LOAD_FAILURE_POLICY.
    #[arg(long, env = "TANDEM_KV_LOAD_FAILURE_POLICY")]
    pub kv_load_failure_policy: Option<String>,
    /// KV transport prefill workers push over: tcp (trusted network) |
    /// quic (TLS; see the quic_* fields) | local (same host, shared memory) |
    /// ucx (one-sided writes: on one host straight into the pool, see
    /// `ucx_direct`, else into a registered landing region; UCX picks RDMA,
    /// shared memory or TCP from `UCX_TLS`).
    /// Env: TANDEM_KV_TRANSPORT. Default tcp.
    #[arg(long, env = "TANDEM_KV_TRANSPORT")]
    pub kv_transport: Option<String>,
    /// KV transfer listen address: host:port for tcp and quic (default
    /// 127.0.0.1:0), a Unix socket path or `@name` for local (default
    /// `@tandem-kv-<pid>`). Not used by ucx (UCX binds its own transports;
    /// the worker advertises its UCX worker address). Env: TANDEM_TRANSFER.
    #[arg(long, env = "TANDEM_TRANSFER")]
    pub transfer: Option<String>,
    /// Transfer address given to prefill workers, when it differs from the
    /// bound one (NAT, 0.0.0.0 binds, a proxy). Env: TANDEM_ADVERTISE_TRANSFER.
    /// Default: the bound address.
    #[arg(long, env = "TANDEM_ADVERTISE_TRANSFER")]
    pub advertise_transfer: Option<String>,
    /// gRPC address registered for coordinators, when it differs from the
    /// bound one (NAT, 0.0.0.0 binds, a proxy). Env: TANDEM_ADVERTISE_GRPC.
    /// Default: the bound address.
    #[arg(long, env = "TANDEM_ADVERTISE_GRPC")]
    pub advertise_grpc: Option<String>,
    /// Lease of a KV reservation: the prefill worker must deliver every
    /// layer within it. Env: TANDEM_RESERVATION_TTL_MS. Default 30000.
    #[arg(long, env = "TANDEM_RESERVATION_TTL_MS")]
    pub reservation_ttl_ms: Option<u64>,
    /// Most prefill workers tried for one request under `retry`. Env:
    /// TANDEM_MAX_PREFILL_ATTEMPTS. Default 3.
    #[arg(long, env = "TANDEM_MAX_PREFILL_ATTEMPTS")]
    pub max_prefill_attempts: Option<usize>,
    /// A KV connection with no byte for this long is closed, ms. Env:
    /// TANDEM_TRANSFER_IDLE_TIMEOUT_MS. Default 30000.
    #[arg(long, env = "TANDEM_TRANSFER_IDLE_TIMEOUT_MS")]
    pub transfer_idle_timeout_ms: Option<u64>,
    /// ucx only: MiB of the landing region registered at start, the most KV
    /// in flight (and quarantined) at once; a reservation that does not fit
    /// is refused as `landing_full`. Env: TANDEM_UCX_LANDING_MIB. Default 256.
    #[arg(long, env = "TANDEM_UCX_LANDING_MIB")]
    pub ucx_landing_mib: Option<usize>,
    /// ucx only: keep the KV pool in memory UCX registered, so that prefill
    /// workers on this host (shared memory) store KV straight into the
    /// pool blocks of their reservation, fenced per reservation; senders
    /// elsewhere, or UCX without a shared-memory mapping, use the landing
    /// region. Env: TANDEM_UCX_DIRECT. Default true.
    #[arg(long, env = "TANDEM_UCX_DIRECT")]
    pub ucx_direct: Option<bool>,
    /// tcp only: keep the KV pool in memory the transfer server maps, so
    /// that each accepted payload is read from the socket straight into its
    /// reservation's pool blocks (one copy, no buffer, nothing for the
    /// engine thread to write); `false`: payloads are read into buffers and
    /// written into the pool on the engine thread. Env: TANDEM_TCP_DIRECT.
    /// Default true.
    #[arg(long, env = "TANDEM_TCP_DIRECT")]
    pub tcp_direct: Option<bool>,
    /// Under `recompute`, prompt tokens per second this worker prefills
    /// itself for requests whose prefill worker refused them as overloaded;
    /// beyond it such a request is refused as `overloaded` (503 +
    /// Retry-After at the coordinator), so running streams keep their pace.
    /// 0: never. Env: TANDEM_MAX_ABSORBED_PREFILL_TOKENS_PER_S. Default 512.
    #[arg(long, env = "TANDEM_MAX_ABSORBED_PREFILL_TOKENS_PER_S")]
    pub max_absorbed_prefill_tokens_per_s: Option<u64>,
}

/// The validated decode worker config.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeConfig {
    pub common: CommonConfig,
    pub policy: KvLoadFailurePolicy,
    pub transport: kvtransfer::TransportKind,
    /// host:port (tcp, quic) or a socket path / `@name` (local).
    pub transfer: String,
    pub advertise_transfer: Option<String>,
    pub advertise_grpc: Option<String>,
    pub reservation_ttl: Duration,
    pub max_prefill_attempts: usize,
    pub transfer_idle_timeout: Duration,
    /// See [`DecodeFlags::max_absorbed_prefill_tokens_per_s`].
    pub max_absorbed_prefill_tokens_per_s: u64,
    /// ucx: bytes of the landing region.
    pub ucx_landing_bytes: usize,
    /// ucx: the pool in UCX memory for direct writes ([`DecodeFlags::ucx_direct`]).
    pub ucx_direct: bool,
    /// tcp: payloads read straight into the pool ([`DecodeFlags::tcp_direct`]).
    pub tcp_direct: bool,
}

impl DecodeConfig {
    /// Defaults < the `--config` file < env and flags (already in `flags`).
    pub fn load(flags: &DecodeFlags) -> Result<Self, ConfigError> {
        let mut merged = match &flags.common.config {
            Some(path) => read_file::<DecodeFlags>(path)?,
            None => DecodeFlags::default(),
        };
        merged.common.overlay(&flags.common);
        worker_common::overlay!(
            merged,
            flags,
            kv_load_failure_policy,
            kv_transport,
            transfer,
            advertise_transfer,
            advertise_grpc,
            reservation_ttl_ms,
            max_prefill_attempts,
            transfer_idle_timeout_ms,
            max_absorbed_prefill_tokens_per_s,
            ucx_landing_mib,
            ucx_direct,
            tcp_direct
        );
        Self::resolve(&merged)
    }

    pub fn resolve(f: &DecodeFlags) -> Result<Self, ConfigError> {
        let common = f.common.resolve()?;
        // Required, with no default: the operator must choose what a failed KV load means.
        let text = f.kv_load_failure_policy.as_deref().ok_or_else(|| {
            invalid("kv_load_failure_policy", "is required: recompute | retry | fail (see docs/ARCHITECTURE.md)")
        })?;
        let policy = KvLoadFailurePolicy::parse(text)
            .ok_or_else(|| invalid("kv_load_failure_policy", format!("{text:?}: use recompute, retry or fail")))?;
        let transport_text = f.kv_transport.as_deref().unwrap_or("tcp");
        let transport = kvtransfer::TransportKind::parse(transport_text)
            .ok_or_else(|| invalid("kv_transport", format!("{transport_text:?}: use tcp, quic, local or ucx")))?;
        let transfer = match (transport, f.transfer.as_deref()) {
            (kvtransfer::TransportKind::Local, None) => format!("@tandem-kv-{}", std::process::id()),
            (kvtransfer::TransportKind::Local, Some("")) => {
                return Err(invalid("transfer", "is empty"));
            }
            (kvtransfer::TransportKind::Local, Some(a)) => a.to_owned(),
            // UCX binds its own transports; the address is the worker's, known once it starts.
            (kvtransfer::TransportKind::Ucx, _) => String::new(),
            (_, a) => socket_addr("transfer", a.unwrap_or("127.0.0.1:0"))?.to_string(),
        };
        if let Some(a) = f.advertise_transfer.as_deref() {
            match transport {
                kvtransfer::TransportKind::Local => {}
                kvtransfer::TransportKind::Ucx => {
                    return Err(invalid(
                        "advertise_transfer",
                        "does not apply to ucx (the UCX worker address is advertised)",
                    ))
                }
                _ => {
                    socket_addr("advertise_transfer", a)?;
                }
            }
        }
        if let Some(a) = f.advertise_grpc.as_deref() {
            socket_addr("advertise_grpc", a)?;
        }
        Ok(Self {
            common,
            policy,
            transport,
            transfer,
            advertise_transfer: f.advertise_transfer.clone(),
            advertise_grpc: f.advertise_grpc.clone(),
            reservation_ttl: millis("reservation_ttl_ms", f.reservation_ttl_ms, 30_000)?,
            max_prefill_attempts: positive("max_prefill_attempts", f.max_prefill_attempts, 3)?,
            transfer_idle_timeout: millis("transfer_idle_timeout_ms", f.transfer_idle_timeout_ms, 30_000)?,
            max_absorbed_prefill_tokens_per_s: f
                .max_absorbed_prefill_tokens_per_s
                .unwrap_or(DEFAULT_MAX_ABSORBED_PREFILL_TOKENS_PER_S),
            ucx_landing_bytes: positive("ucx_landing_mib", f.ucx_landing_mib, 256)?
                .checked_mul(1 << 20)
                .ok_or_else(|| invalid("ucx_landing_mib", "is too large"))?,
            ucx_direct: f.ucx_direct.unwrap_or(true),
            tcp_direct: f.tcp_direct.unwrap_or(true),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use worker_common::config::fixtures::{common, some_file};

    /// The command line `tandem up` and the drills build is one this worker's parser takes,
    /// flag for flag (the flags both workers share are checked by the prefill worker's twin).
    #[test]
    fn the_shared_argv_builder_speaks_this_workers_flags() {
        let argv = facts::argv::WorkerArgv::decode()
            .worker_id("decode-0")
            .transfer("127.0.0.1:0")
            .advertise_transfer("127.0.0.1:9")
            .advertise_grpc("127.0.0.1:8")
            .kv_transport("ucx")
            .kv_load_failure_policy("retry");
        assert_eq!(argv.binary(), <DecodeFlags as clap::CommandFactory>::command().get_name());
        let f = DecodeFlags::try_parse_from(std::iter::once("w".to_owned()).chain(argv.build())).expect("parses");
        assert_eq!(f.common.worker_id.as_deref(), Some("decode-0"));
        assert_eq!(
            (f.transfer.as_deref(), f.advertise_transfer.as_deref()),
            (Some("127.0.0.1:0"), Some("127.0.0.1:9"))
        );
        assert_eq!(f.advertise_grpc.as_deref(), Some("127.0.0.1:8"));
        assert_eq!(f.kv_transport.as_deref(), Some("ucx"));
        assert_eq!(f.kv_load_failure_policy.as_deref(), Some("retry"));
    }

    fn flags(policy: Option<&str>) -> DecodeFlags {
        DecodeFlags {
            common: common(Some("g")),
            kv_load_failure_policy: policy.map(Into::into),
            ..DecodeFlags::default()
        }
    }

    #[test]
    fn policy_is_required_and_checked() {
        for (policy, want) in [(None, "is required"), (Some("sometimes"), "\"sometimes\"")] {
            let err = DecodeConfig::resolve(&flags(policy)).err().map(|e| e.to_string());
            assert!(
                err.as_deref().is_some_and(|e| e.contains("`kv_load_failure_policy`") && e.contains(want)),
                "{err:?}"
            );
        }
        for p in KvLoadFailurePolicy::ALL {
            let cfg = DecodeConfig::resolve(&flags(Some(p.as_str()))).map_err(|e| e.to_string());
            assert_eq!(cfg.map(|c| c.policy), Ok(p));
        }
    }

    #[test]
    fn bad_fields_are_named() {
        let cases = [
            (DecodeFlags { reservation_ttl_ms: Some(0), ..flags(Some("fail")) }, "`reservation_ttl_ms`"),
            (DecodeFlags { max_prefill_attempts: Some(0), ..flags(Some("fail")) }, "`max_prefill_attempts`"),
            (DecodeFlags { transfer: Some("here".into()), ..flags(Some("fail")) }, "`transfer`"),
            (DecodeFlags { kv_transport: Some("carrier-pigeon".into()), ..flags(Some("fail")) }, "`kv_transport`"),
            (DecodeFlags { advertise_transfer: Some("x".into()), ..flags(Some("fail")) }, "`advertise_transfer`"),
            (DecodeFlags { advertise_grpc: Some("x".into()), ..flags(Some("fail")) }, "`advertise_grpc`"),
            (DecodeFlags { ucx_landing_mib: Some(0), ..flags(Some("fail")) }, "`ucx_landing_mib`"),
            (
                DecodeFlags {
                    kv_transport: Some("ucx".into()),
                    advertise_transfer: Some("10.0.0.1:7003".into()),
                    ..flags(Some("fail"))
                },
                "`advertise_transfer`",
            ),
        ];
        for (f, field) in cases {
            let err = DecodeConfig::resolve(&f).err().map(|e| e.to_string());
            assert!(err.as_deref().is_some_and(|e| e.contains(field)), "{field}: {err:?}");
        }
    }

    #[test]
    fn file_sets_policy_and_flags_override_it() {
        let dir = std::env::temp_dir().join(format!("tandem-dw-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok();
        let path = dir.join("d.toml");
        let text = format!(
            "version_group = \"g\"\nkv_load_failure_policy = \"retry\"\nreservation_ttl_ms = 500\nmodel = {:?}\n",
            some_file()
        );
        std::fs::write(&path, text).ok();
        let mut f = DecodeFlags::default();
        f.common.config = Some(path.clone());
        let cfg = DecodeConfig::load(&f).map_err(|e| e.to_string());
        assert_eq!(
            cfg.as_ref().map(|c| (c.policy, c.reservation_ttl)),
            Ok((KvLoadFailurePolicy::Retry, Duration::from_millis(500)))
        );
        f.kv_load_failure_policy = Some("fail".into());
        let cfg = DecodeConfig::load(&f).map_err(|e| e.to_string());
        assert_eq!(cfg.map(|c| c.policy), Ok(KvLoadFailurePolicy::Fail));
    }
}

#[cfg(test)]
mod shipped_config {
    use super::*;

    /// The shipped config parses and names its policy explicitly.
    #[test]
    fn shipped_config_loads() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
        let text = std::fs::read_to_string(root.join("decode-worker.toml")).unwrap_or_default();
        assert!(text.lines().any(|l| l.starts_with("kv_load_failure_policy = ")), "{text}");
        let d = read_file::<DecodeFlags>(&root.join("decode-worker.toml")).map_err(|e| e.to_string());
        let d = d.and_then(|mut f| {
            f.common.model = Some(worker_common::config::fixtures::some_file());
            DecodeConfig::resolve(&f).map_err(|e| e.to_string())
        });
        assert_eq!(d.map(|c| c.policy), Ok(KvLoadFailurePolicy::Recompute));
    }
}
