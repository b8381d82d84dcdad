//! Config plumbing shared by both worker binaries.
//!
//! Each binary has one typed config built from, lowest to highest:
//! defaults, a TOML file (`--config`), `TANDEM_*` env, flags. clap reads env
//! and flags together (a flag beats its env var); the TOML file has the same
//! keys as the flags in snake_case. Unknown TOML keys are refused by name,
//! checked against the flags clap knows, so the two can never drift apart.
//! Validation errors name the field.
//!
//! [`CommonFlags`] holds what both workers take (model, addresses, engine
//! sizing, drain); each binary flattens it into its own flags struct.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, CommandFactory};
use engine::batch::EngineConfig;
use kvtransfer::VersionGroup;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use types::kv::KvDtype;

/// Why the config could not be built.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The `--config` file could not be read.
    #[error("config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    /// The `--config` file is not valid TOML for this config (the message names the key).
    #[error("config file {path}: {message}")]
    Parse { path: PathBuf, message: String },
    /// A field has a value the worker cannot run with.
    #[error("config field `{field}`: {why}")]
    Invalid { field: &'static str, why: String },
}

pub fn invalid(field: &'static str, why: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field, why: why.into() }
}

/// Flags both workers take; every one also readable from its `TANDEM_*`
/// env var and, without the `--`, as a TOML key.
#[derive(Debug, Default, Clone, Args, Deserialize)]
#[serde(default)]
pub struct CommonFlags {
    /// TOML config file (keys as the flags, snake_case). Env: TANDEM_CONFIG.
    #[arg(long, env = "TANDEM_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// GGUF model file. Env: TANDEM_MODEL. Default: the cached SmolLM2 file.
    #[arg(long, env = "TANDEM_MODEL")]
    pub model: Option<PathBuf>,
    /// gRPC listen address. Env: TANDEM_GRPC. Default 127.0.0.1:0.
    #[arg(long, env = "TANDEM_GRPC")]
    pub grpc: Option<String>,
    /// Prometheus `/metrics` listen address. Env: TANDEM_METRICS. Default 127.0.0.1:0.
    #[arg(long, env = "TANDEM_METRICS")]
    pub metrics: Option<String>,
    /// Model compute threads. Env: TANDEM_THREADS. Default: available cores.
    #[arg(long, env = "TANDEM_THREADS")]
    pub threads: Option<usize>,
    /// Nice level of the whole process (-20..19), applied before any thread
    /// starts: on a host where workers share cores, a prefill worker niced
    /// above the decode worker gives way to decode steps and still uses
    /// every cycle they leave. Env: TANDEM_NICE. Default: unchanged.
    #[arg(long, env = "TANDEM_NICE", allow_negative_numbers = true)]
    pub nice: Option<i32>,
    /// Pin the process to these CPUs (`0-3,6`). Env: TANDEM_CPUS. Default: unpinned.
    #[arg(long, env = "TANDEM_CPUS")]
    pub cpus: Option<String>,
    /// Version group label (required). Env: TANDEM_VERSION_GROUP.
    #[arg(long, env = "TANDEM_VERSION_GROUP")]
    pub version_group: Option<String>,
    /// The zone this worker runs in (a cloud zone, a rack), registered for
    /// coordinators' `--zone-pairing`: at most 256 bytes, no whitespace. Env: TANDEM_ZONE.
    /// Default: none.
    #[arg(long, env = "TANDEM_ZONE")]
    pub zone: Option<String>,
    /// Tokens per KV block. Env: TANDEM_KV_BLOCK_SIZE. Default 16.
    #[arg(long, env = "TANDEM_KV_BLOCK_SIZE")]
    pub kv_block_size: Option<usize>,
    /// KV element type, f16 | f32. Env: TANDEM_KV_DTYPE. Default f16.
    #[arg(long, env = "TANDEM_KV_DTYPE")]
    pub kv_dtype: Option<String>,
    /// KV blocks in the pool. Env: TANDEM_KV_BLOCKS. Default 1024.
    #[arg(long, env = "TANDEM_KV_BLOCKS")]
    pub kv_blocks: Option<usize>,
    /// Token budget of one engine step. Env: TANDEM_MAX_BATCH_TOKENS. Default 512.
    #[arg(long, env = "TANDEM_MAX_BATCH_TOKENS")]
    pub max_batch_tokens: Option<usize>,
    /// Sequences in the running batch. Env: TANDEM_MAX_RUNNING. Default 16.
    #[arg(long, env = "TANDEM_MAX_RUNNING")]
    pub max_running: Option<usize>,
    /// While requests stream tokens, the longest an engine step may take
    /// with prefill in it, ms: a long prompt prefilled here is cut into
    /// chunks that fit beside the running streams (by measured step costs;
    /// at least one block per step). 0: off (chunks take the whole
    /// `max_batch_tokens`). Env: TANDEM_MAX_DECODE_STALL_MS. Default 200
    /// (measured: `tandem bench stall`, see README).
    #[arg(long, env = "TANDEM_MAX_DECODE_STALL_MS")]
    pub max_decode_stall_ms: Option<u64>,
    /// Prompt-lookup speculation: up to this many draft tokens per decoding
    /// sequence and step, copied from its own prompt and text so far and
    /// checked in the same forward pass (outputs are plain decoding's). 0:
    /// off. Env: TANDEM_PROMPT_LOOKUP. Default 0.
    #[arg(long, env = "TANDEM_PROMPT_LOOKUP")]
    pub prompt_lookup: Option<usize>,
    /// Requests queued beyond the running seats; more are refused as
    /// overloaded. Env: TANDEM_MAX_WAITING. Default 64.
    #[arg(long, env = "TANDEM_MAX_WAITING")]
    pub max_waiting: Option<usize>,
    /// Drain grace on SIGTERM/SIGINT, ms. Env: TANDEM_SHUTDOWN_TIMEOUT_MS. Default 10000.
    #[arg(long, env = "TANDEM_SHUTDOWN_TIMEOUT_MS")]
    pub shutdown_timeout_ms: Option<u64>,
    /// QUIC KV transport: this worker's certificate chain (PEM). With
    /// `quic_key`; without both, a decode worker makes a self-signed one at
    /// start-up (development). Env: TANDEM_QUIC_CERT.
    #[arg(long, env = "TANDEM_QUIC_CERT")]
    pub quic_cert: Option<PathBuf>,
    /// QUIC KV transport: the private key of `quic_cert` (PEM). Env: TANDEM_QUIC_KEY.
    #[arg(long, env = "TANDEM_QUIC_KEY")]
    pub quic_key: Option<PathBuf>,
    /// QUIC KV transport: the cluster CA (PEM). A prefill worker trusts
    /// decode workers' certificates issued by it (else it pins the
    /// self-signed certificate a destination names); a decode worker
    /// requires prefill workers to present one (mutual TLS). Env: TANDEM_QUIC_CA.
    #[arg(long, env = "TANDEM_QUIC_CA")]
    pub quic_ca: Option<PathBuf>,
    /// etcd endpoints (comma-separated `http://host:port`): register this
    /// worker under a lease so coordinators find it. Unset: no registration.
    /// Env: TANDEM_ETCD.
    #[arg(long, env = "TANDEM_ETCD")]
    pub etcd: Option<String>,
    /// Cluster prefix of the etcd keys. Env: TANDEM_CLUSTER_PREFIX. Default `tandem`.
    #[arg(long, env = "TANDEM_CLUSTER_PREFIX")]
    pub cluster_prefix: Option<String>,
    /// This worker's registry id, unique per role in the cluster. Env:
    /// TANDEM_WORKER_ID. Default `<host>-<pid>`.
    #[arg(long, env = "TANDEM_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Registration lease TTL, whole seconds. Env: TANDEM_LEASE_TTL_S. Default 5.
    #[arg(long, env = "TANDEM_LEASE_TTL_S")]
    pub lease_ttl_s: Option<u64>,
    /// Fence (take no new work) once no coordinator has called `Health` for
    /// this long, ms, after one has: the worker is cut off from its
    /// coordinators. Never before the first call. 0: off. Env:
    /// TANDEM_COORDINATOR_SILENCE_FENCE_MS. Default 5000 (20 of the
    /// coordinator's 250 ms load polls; the default lease TTL).
    #[arg(long, env = "TANDEM_COORDINATOR_SILENCE_FENCE_MS")]
    pub coordinator_silence_fence_ms: Option<u64>,
    /// Directory where the workers of one host share the model's packed
    /// weight panels (one copy per host, packed by the first worker to
    /// start, checked by SHA-256 by every other), or `off` for private
    /// panels. Env: TANDEM_PANEL_DIR. Default `/dev/shm/tandem-panels-UID`
    /// (if unusable — full, not ours — the worker packs privately and says
    /// why; a directory named here must work).
    #[arg(long, env = "TANDEM_PANEL_DIR")]
    pub panel_dir: Option<String>,
    /// Log line format: `text` or `json` (one object per line, for collectors). The
    /// filter is TANDEM_LOG, else RUST_LOG, else `info`. Env: TANDEM_LOG_FORMAT.
    /// Default text.
    #[arg(long, env = "TANDEM_LOG_FORMAT")]
    pub log_format: Option<String>,
}

/// Overlays the set fields of `$b` on `$a`.
#[macro_export]
macro_rules! overlay {
    ($a:expr, $b:expr, $($f:ident),* $(,)?) => { $( if $b.$f.is_some() { $a.$f = $b.$f.clone(); } )* };
}
pub use crate::overlay;

impl CommonFlags {
    /// Overlays the fields `later` sets.
    pub fn overlay(&mut self, later: &Self) {
        overlay!(
            self,
            later,
            model,
            grpc,
            metrics,
            threads,
            nice,
            cpus,
            version_group,
            zone,
            kv_block_size,
            kv_dtype,
            kv_blocks,
            max_batch_tokens,
            max_running,
            max_decode_stall_ms,
            prompt_lookup,
            max_waiting,
            shutdown_timeout_ms,
            quic_cert,
            quic_key,
            quic_ca,
            etcd,
            cluster_prefix,
            worker_id,
            lease_ttl_s,
            coordinator_silence_fence_ms,
            panel_dir,
            log_format
        );
    }
}

/// `max_decode_stall_ms` when unset: with two decoders and a 1,024-token
/// prompt arriving on 2 cores it cut the worst inter-token gap from 4.3 s to
/// 0.31 s for 1.21x the prompt's time to first token (25-100 ms gave no
/// shorter gap, one block per step being the floor, for 1.31-1.36x).
pub const DEFAULT_DECODE_STALL_MS: u64 = 200;

/// The most draft tokens `prompt_lookup` takes: a longer draft is rarely
/// accepted whole, and every drafted token is computed.
pub const MAX_PROMPT_LOOKUP: usize = 16;

/// The validated common part of a worker's config.
#[derive(Debug, Clone, PartialEq)]
pub struct CommonConfig {
    pub model: PathBuf,
    pub grpc: SocketAddr,
    /// Where `/metrics` is served (port 0: any free port, printed at start-up).
    pub metrics: SocketAddr,
    pub threads: usize,
    /// See the flags; `None`: leave as inherited.
    pub nice: Option<i32>,
    pub cpus: Option<facts::cpus::CpuList>,
    pub version_group: VersionGroup,
    /// See the flags; empty: none given.
    pub zone: String,
    pub kv_block_size: usize,
    pub kv_dtype: KvDtype,
    pub kv_blocks: usize,
    pub max_batch_tokens: usize,
    pub max_running: usize,
    /// See the flags; `None`: off.
    pub max_decode_stall: Option<Duration>,
    /// Draft tokens per decoding sequence and step; 0: off.
    pub prompt_lookup: usize,
    pub max_waiting: usize,
    pub shutdown_timeout: Duration,
    pub quic: QuicFiles,
    /// Where to register, if anywhere.
    pub registry: Option<RegistrySettings>,
    /// Fence after this long without a coordinator's `Health` call (once
    /// one has called); `None`: never.
    pub coordinator_silence_fence: Option<Duration>,
    pub panels: PanelDir,
    pub log_format: facts::log::LogFormat,
}

/// Where the packed weight panels live (see the flag).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PanelDir {
    /// This process's own memory.
    Off,
    /// The default host directory: if it cannot be used, private panels.
    Default(PathBuf),
    /// A directory the operator named: it must be usable.
    Named(PathBuf),
}

impl PanelDir {
    /// The engine's panel home for the model with this SHA-256.
    pub fn home(&self, model_digest: [u8; 32]) -> engine::weights::panels::PanelHome {
        use engine::weights::panels::{PanelHome, PanelStore};
        let store = |dir: &PathBuf, private_on_error| {
            PanelHome::Host(PanelStore { dir: dir.clone(), model_digest, private_on_error })
        };
        match self {
            PanelDir::Off => PanelHome::Private,
            PanelDir::Default(d) => store(d, true),
            PanelDir::Named(d) => store(d, false),
        }
    }
}

/// etcd registration settings (see the flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistrySettings {
    pub endpoints: Vec<String>,
    pub prefix: String,
    pub worker_id: String,
    pub lease_ttl: Duration,
}

/// PEM files for the QUIC transport (see the flags).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuicFiles {
    /// Certificate chain and key, both or neither.
    pub identity: Option<(PathBuf, PathBuf)>,
    pub ca: Option<PathBuf>,
}

impl QuicFiles {
    /// This worker's identity from the PEM files, if configured.
    pub fn load_identity(&self) -> Result<Option<kvtransfer::TlsIdentity>, kvtransfer::TlsError> {
        self.identity.as_ref().map(|(c, k)| kvtransfer::TlsIdentity::from_pem_files(c, k)).transpose()
    }

    /// The cluster CA from its PEM file, if configured.
    pub fn load_ca(&self) -> Result<Option<kvtransfer::PeerTrust>, kvtransfer::TlsError> {
        self.ca.as_ref().map(kvtransfer::PeerTrust::ca_from_pem_file).transpose()
    }
}

impl CommonConfig {
    /// The engine settings this config describes (prefix cache on).
    pub fn engine(&self) -> EngineConfig {
        EngineConfig {
            block_size: self.kv_block_size,
            kv_dtype: self.kv_dtype,
            kv_blocks: self.kv_blocks,
            max_batch_tokens: self.max_batch_tokens,
            max_running: self.max_running,
            prefix_cache: true,
            max_decode_stall_ms: self.max_decode_stall.map(|d| d.as_secs_f64() * 1e3),
            prompt_lookup: self.prompt_lookup,
        }
    }
}

/// Parses `text` (the value of `field`) as host:port.
pub fn socket_addr(field: &'static str, text: &str) -> Result<SocketAddr, ConfigError> {
    text.parse().map_err(|e| invalid(field, format!("{text:?} is not host:port ({e})")))
}

/// A value that must be at least 1, or its default.
pub fn positive<T: Copy + PartialEq + Default>(
    field: &'static str,
    v: Option<T>,
    default: T,
) -> Result<T, ConfigError> {
    match v.unwrap_or(default) {
        n if n == T::default() => Err(invalid(field, "must be at least 1")),
        n => Ok(n),
    }
}

/// A duration in milliseconds that must be at least 1 ms, or its default.
pub fn millis(field: &'static str, v: Option<u64>, default: u64) -> Result<Duration, ConfigError> {
    positive(field, v, default).map(Duration::from_millis)
}

impl CommonFlags {
    /// Applies defaults and validates every field.
    pub fn resolve(&self) -> Result<CommonConfig, ConfigError> {
        let grpc = socket_addr("grpc", self.grpc.as_deref().unwrap_or("127.0.0.1:0"))?;
        let metrics = socket_addr("metrics", self.metrics.as_deref().unwrap_or("127.0.0.1:0"))?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = positive("threads", self.threads, cores)?;
        let group = self.version_group.as_deref().ok_or_else(|| invalid("version_group", "is required"))?;
        let version_group = VersionGroup::new(group).map_err(|e| invalid("version_group", e.to_string()))?;
        let dtype_text = self.kv_dtype.as_deref().unwrap_or("f16");
        let kv_dtype =
            KvDtype::parse(dtype_text).ok_or_else(|| invalid("kv_dtype", format!("{dtype_text:?}: use f16 or f32")))?;
        let silence_ms = self.coordinator_silence_fence_ms.unwrap_or(5000);
        let log_format = match self.log_format.as_deref() {
            Some(f) => f.parse().map_err(|e: String| invalid("log_format", e))?,
            None => facts::log::LogFormat::default(),
        };
        let panels = match self.panel_dir.as_deref() {
            None => PanelDir::Default(engine::paths::default_panel_dir()),
            Some("off") => PanelDir::Off,
            Some("") => return Err(invalid("panel_dir", "is empty: name a directory, or `off`")),
            Some(d) => PanelDir::Named(PathBuf::from(d)),
        };
        let cfg = CommonConfig {
            panels,
            log_format,
            coordinator_silence_fence: (silence_ms > 0).then(|| Duration::from_millis(silence_ms)),
            model: self.model.clone().unwrap_or_else(engine::paths::default_model_path),
            grpc,
            metrics,
            threads,
            nice: match self.nice {
                Some(n) if !(-20..=19).contains(&n) => return Err(invalid("nice", format!("{n} is outside -20..19"))),
                n => n,
            },
            cpus: self
                .cpus
                .as_deref()
                .map(|t| facts::cpus::CpuList::parse(t).map_err(|e| invalid("cpus", format!("{t:?}: {e}"))))
                .transpose()?,
            version_group,
            zone: {
                let zone = self.zone.clone().unwrap_or_default();
                registry::check_zone(&zone).map_err(|e| invalid("zone", format!("{zone:?}: {e}")))?;
                zone
            },
            kv_block_size: positive("kv_block_size", self.kv_block_size, 16)?,
            kv_dtype,
            kv_blocks: positive("kv_blocks", self.kv_blocks, 1024)?,
            max_batch_tokens: positive("max_batch_tokens", self.max_batch_tokens, 512)?,
            max_running: positive("max_running", self.max_running, 16)?,
            max_decode_stall: Some(self.max_decode_stall_ms.unwrap_or(DEFAULT_DECODE_STALL_MS))
                .filter(|ms| *ms > 0)
                .map(Duration::from_millis),
            prompt_lookup: match self.prompt_lookup.unwrap_or(0) {
                n if n > MAX_PROMPT_LOOKUP => {
                    return Err(invalid("prompt_lookup", format!("{n} is over {MAX_PROMPT_LOOKUP} draft tokens")))
                }
                n => n,
            },
            max_waiting: self.max_waiting.unwrap_or(64),
            shutdown_timeout: Duration::from_millis(self.shutdown_timeout_ms.unwrap_or(10_000)),
            quic: QuicFiles {
                identity: match (&self.quic_cert, &self.quic_key) {
                    (Some(c), Some(k)) => Some((c.clone(), k.clone())),
                    (None, None) => None,
                    (Some(_), None) => return Err(invalid("quic_key", "is required with quic_cert")),
                    (None, Some(_)) => return Err(invalid("quic_cert", "is required with quic_key")),
                },
                ca: self.quic_ca.clone(),
            },
            registry: match &self.etcd {
                None => None,
                Some(e) => {
                    let endpoints: Vec<String> =
                        e.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned).collect();
                    if endpoints.is_empty() {
                        return Err(invalid("etcd", "no endpoint given"));
                    }
                    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
                    let host: String =
                        host.trim().chars().filter(|c| c.is_ascii_alphanumeric() || "-._".contains(*c)).collect();
                    Some(RegistrySettings {
                        endpoints,
                        prefix: self.cluster_prefix.clone().unwrap_or_else(|| "tandem".into()),
                        worker_id: self.worker_id.clone().unwrap_or_else(|| {
                            format!("{}-{}", if host.is_empty() { "worker" } else { &host }, std::process::id())
                        }),
                        lease_ttl: Duration::from_secs(positive("lease_ttl_s", self.lease_ttl_s, 5)?),
                    })
                }
            },
        };
        for (field, path) in [("quic_cert", &self.quic_cert), ("quic_key", &self.quic_key), ("quic_ca", &self.quic_ca)]
        {
            if let Some(p) = path.as_ref().filter(|p| !p.is_file()) {
                return Err(invalid(field, format!("{} is not a file", p.display())));
            }
        }
        if !cfg.model.is_file() {
            return Err(invalid("model", format!("{} is not a file", cfg.model.display())));
        }
        Ok(cfg)
    }
}

/// Reads a TOML config file into the flags type `F`, refusing any key that
/// is not one of `F`'s flags (by clap's id, the snake_case field name).
pub fn read_file<F: CommandFactory + DeserializeOwned>(path: &Path) -> Result<F, ConfigError> {
    let parse = |message: String| ConfigError::Parse { path: path.into(), message };
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| parse(e.to_string()))?;
    let cmd = F::command();
    let known: Vec<&str> = cmd.get_arguments().map(|a| a.get_id().as_str()).filter(|id| *id != "config").collect();
    if let Some(key) = table.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(parse(format!("unknown field `{key}`; known fields: {}", known.join(", "))));
    }
    table.try_into().map_err(|e: toml::de::Error| parse(e.to_string()))
}

/// Config fixtures for the role crates' unit tests (plain functions, no
/// test-only dependencies, so no feature gate).
pub mod fixtures {
    use super::*;

    /// Any existing file passes the `model` check.
    pub fn some_file() -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"))
    }

    /// Common flags with a model and (optionally) a version group set.
    pub fn common(group: Option<&str>) -> CommonFlags {
        CommonFlags { model: Some(some_file()), version_group: group.map(Into::into), ..CommonFlags::default() }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::common;
    use super::*;

    /// Every flag survives the overlay of the command line on a config file: the struct
    /// literal names every field (no `..`), so a new flag fails to compile here until
    /// it is listed, and is then checked to be carried.
    #[test]
    fn the_overlay_carries_every_flag() {
        let path = || Some(PathBuf::from("/x"));
        let text = |t: &str| Some(t.to_owned());
        let set = CommonFlags {
            config: None,
            model: path(),
            grpc: text("127.0.0.1:1"),
            metrics: text("127.0.0.1:2"),
            threads: Some(3),
            nice: Some(4),
            cpus: text("0"),
            version_group: text("g"),
            zone: text("z"),
            kv_block_size: Some(5),
            kv_dtype: text("f32"),
            kv_blocks: Some(6),
            max_batch_tokens: Some(7),
            max_running: Some(8),
            max_decode_stall_ms: Some(9),
            prompt_lookup: Some(14),
            max_waiting: Some(10),
            shutdown_timeout_ms: Some(11),
            quic_cert: path(),
            quic_key: path(),
            quic_ca: path(),
            etcd: text("http://e"),
            cluster_prefix: text("p"),
            worker_id: text("w"),
            lease_ttl_s: Some(12),
            coordinator_silence_fence_ms: Some(13),
            panel_dir: text("/panels"),
            log_format: text("json"),
        };
        let mut merged = CommonFlags::default();
        merged.overlay(&set);
        assert_eq!(format!("{merged:?}"), format!("{set:?}"));
    }

    /// Unset: the host default, used if it can be (else private panels); `off`:
    /// private; a named directory: must be usable.
    #[test]
    fn panel_dir_default_off_and_named() {
        use engine::weights::panels::PanelHome;
        let resolve = |d: Option<&str>| CommonFlags { panel_dir: d.map(Into::into), ..common(Some("g")) }.resolve();
        let default = resolve(None).map(|c| c.panels.home([7; 32]));
        assert!(
            matches!(&default, Ok(PanelHome::Host(s)) if s.private_on_error && s.dir == engine::paths::default_panel_dir() && s.model_digest == [7; 32]),
            "{default:?}"
        );
        assert!(matches!(resolve(Some("off")).map(|c| c.panels.home([0; 32])), Ok(PanelHome::Private)));
        let named = resolve(Some("/srv/panels")).map(|c| c.panels.home([0; 32]));
        assert!(
            matches!(&named, Ok(PanelHome::Host(s)) if !s.private_on_error && s.dir == Path::new("/srv/panels")),
            "{named:?}"
        );
    }

    #[test]
    fn version_group_is_required_and_named() {
        let err = common(None).resolve().err().map(|e| e.to_string());
        assert!(err.as_deref().is_some_and(|e| e.contains("`version_group`")), "{err:?}");
    }

    #[test]
    fn bad_fields_are_named() {
        let base = || common(Some("g1"));
        let cases = [
            (CommonFlags { kv_dtype: Some("bf8".into()), ..base() }, "`kv_dtype`"),
            (CommonFlags { kv_blocks: Some(0), ..base() }, "`kv_blocks`"),
            (CommonFlags { threads: Some(0), ..base() }, "`threads`"),
            (CommonFlags { nice: Some(20), ..base() }, "`nice`"),
            (CommonFlags { cpus: Some("2-1".into()), ..base() }, "`cpus`"),
            (CommonFlags { grpc: Some("nowhere".into()), ..base() }, "`grpc`"),
            (CommonFlags { metrics: Some("localhost".into()), ..base() }, "`metrics`"),
            (CommonFlags { version_group: Some("a b".into()), ..base() }, "`version_group`"),
            (CommonFlags { model: Some("/nonexistent/model.gguf".into()), ..base() }, "`model`"),
            (CommonFlags { log_format: Some("xml".into()), ..base() }, "`log_format`"),
            (CommonFlags { zone: Some("eu west".into()), ..base() }, "`zone`"),
            (CommonFlags { panel_dir: Some(String::new()), ..base() }, "`panel_dir`"),
            (CommonFlags { prompt_lookup: Some(17), ..base() }, "`prompt_lookup`"),
            (CommonFlags { zone: Some("z".repeat(257)), ..base() }, "`zone`"),
        ];
        for (f, field) in cases {
            let err = f.resolve().err().map(|e| e.to_string());
            assert!(err.as_deref().is_some_and(|e| e.contains(field)), "{field}: {err:?}");
        }
    }
}
