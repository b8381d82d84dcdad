//! The prefill worker's one typed config: defaults, then a TOML file
//! (`--config`), then `TANDEM_*` env, then flags (clap reads env and flags
//! together, so a flag beats its env var). Validation names the field.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use engine::kv::KvDtype;
use kvtransfer::VersionGroup;
use serde::Deserialize;

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

fn invalid(field: &'static str, why: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field, why: why.into() }
}

/// Command-line flags; every one also readable from its `TANDEM_*` env var.
#[derive(Debug, Default, Parser)]
#[command(name = "tandem-prefill-worker", about = "tandem prefill worker")]
pub struct Flags {
    /// TOML config file (keys as in `FileConfig`). Env: TANDEM_CONFIG.
    #[arg(long, env = "TANDEM_CONFIG")]
    pub config: Option<PathBuf>,
    /// GGUF model file. Env: TANDEM_MODEL. Default: engine::paths::default_model_path().
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
    /// Version group label (required). Env: TANDEM_VERSION_GROUP.
    #[arg(long, env = "TANDEM_VERSION_GROUP")]
    pub version_group: Option<String>,
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
    /// Sequences prefilled at once. Env: TANDEM_MAX_RUNNING. Default 16.
    #[arg(long, env = "TANDEM_MAX_RUNNING")]
    pub max_running: Option<usize>,
    /// Requests queued beyond the running seats. Env: TANDEM_MAX_WAITING. Default 64.
    #[arg(long, env = "TANDEM_MAX_WAITING")]
    pub max_waiting: Option<usize>,
    /// Drain grace on SIGTERM/SIGINT, ms. Env: TANDEM_SHUTDOWN_TIMEOUT_MS. Default 10000.
    #[arg(long, env = "TANDEM_SHUTDOWN_TIMEOUT_MS")]
    pub shutdown_timeout_ms: Option<u64>,
    /// KV transfer timeout (connect, each frame, Ack), ms. Env: TANDEM_TRANSFER_TIMEOUT_MS. Default 10000.
    #[arg(long, env = "TANDEM_TRANSFER_TIMEOUT_MS")]
    pub transfer_timeout_ms: Option<u64>,
}

/// The TOML file: the same keys as the flags (snake_case), all optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub model: Option<PathBuf>,
    pub grpc: Option<String>,
    pub metrics: Option<String>,
    pub threads: Option<usize>,
    pub version_group: Option<String>,
    pub kv_block_size: Option<usize>,
    pub kv_dtype: Option<String>,
    pub kv_blocks: Option<usize>,
    pub max_batch_tokens: Option<usize>,
    pub max_running: Option<usize>,
    pub max_waiting: Option<usize>,
    pub shutdown_timeout_ms: Option<u64>,
    pub transfer_timeout_ms: Option<u64>,
}

/// The validated config the worker runs with.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub model: PathBuf,
    pub grpc: SocketAddr,
    /// Where `/metrics` is served (port 0: any free port, printed at start-up).
    pub metrics: SocketAddr,
    pub threads: usize,
    pub version_group: VersionGroup,
    pub kv_block_size: usize,
    pub kv_dtype: KvDtype,
    pub kv_blocks: usize,
    pub max_batch_tokens: usize,
    pub max_running: usize,
    pub max_waiting: usize,
    pub shutdown_timeout: Duration,
    pub transfer_timeout: Duration,
}

/// Overlays `b` on `a`: the later source wins where it is set.
macro_rules! layer {
    ($a:expr, $b:expr, $($f:ident),*) => { $( if $b.$f.is_some() { $a.$f = $b.$f.clone(); } )* };
}

impl Config {
    /// Builds the config from parsed flags (which already hold env values),
    /// reading the TOML file they name, if any.
    pub fn load(flags: &Flags) -> Result<Self, ConfigError> {
        let mut merged = match &flags.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        layer!(
            merged,
            flags,
            model,
            grpc,
            metrics,
            threads,
            version_group,
            kv_block_size,
            kv_dtype,
            kv_blocks,
            max_batch_tokens,
            max_running,
            max_waiting,
            shutdown_timeout_ms,
            transfer_timeout_ms
        );
        Self::resolve(merged)
    }

    /// Applies defaults to unset fields and validates every field.
    pub fn resolve(f: FileConfig) -> Result<Self, ConfigError> {
        let grpc_text = f.grpc.unwrap_or_else(|| "127.0.0.1:0".into());
        let grpc = grpc_text.parse().map_err(|e| invalid("grpc", format!("{grpc_text:?} is not host:port ({e})")))?;
        let metrics_text = f.metrics.unwrap_or_else(|| "127.0.0.1:0".into());
        let metrics =
            metrics_text.parse().map_err(|e| invalid("metrics", format!("{metrics_text:?} is not host:port ({e})")))?;
        let threads = f.threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        if threads == 0 {
            return Err(invalid("threads", "must be at least 1"));
        }
        let group = f.version_group.ok_or_else(|| invalid("version_group", "is required"))?;
        let version_group = VersionGroup::new(&group).map_err(|e| invalid("version_group", e.to_string()))?;
        let dtype_text = f.kv_dtype.unwrap_or_else(|| "f16".into());
        let kv_dtype = KvDtype::parse(&dtype_text)
            .ok_or_else(|| invalid("kv_dtype", format!("{dtype_text:?}: use f16 or f32")))?;
        let positive = |field: &'static str, v: Option<usize>, default: usize| match v.unwrap_or(default) {
            0 => Err(invalid(field, "must be at least 1")),
            n => Ok(n),
        };
        let cfg = Self {
            model: f.model.unwrap_or_else(engine::paths::default_model_path),
            grpc,
            metrics,
            threads,
            version_group,
            kv_block_size: positive("kv_block_size", f.kv_block_size, 16)?,
            kv_dtype,
            kv_blocks: positive("kv_blocks", f.kv_blocks, 1024)?,
            max_batch_tokens: positive("max_batch_tokens", f.max_batch_tokens, 512)?,
            max_running: positive("max_running", f.max_running, 16)?,
            max_waiting: f.max_waiting.unwrap_or(64),
            shutdown_timeout: Duration::from_millis(f.shutdown_timeout_ms.unwrap_or(10_000)),
            transfer_timeout: Duration::from_millis(f.transfer_timeout_ms.unwrap_or(10_000)),
        };
        if cfg.transfer_timeout.is_zero() {
            return Err(invalid("transfer_timeout_ms", "must be at least 1"));
        }
        if !cfg.model.is_file() {
            return Err(invalid("model", format!("{} is not a file", cfg.model.display())));
        }
        Ok(cfg)
    }
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.into(), source })?;
    toml::from_str(&text).map_err(|e| ConfigError::Parse { path: path.into(), message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_model(mut f: FileConfig) -> FileConfig {
        // Any existing file passes the `model` check.
        f.model = Some(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")));
        f
    }

    #[test]
    fn version_group_is_required_and_named() {
        let err = Config::resolve(with_model(FileConfig::default())).err().map(|e| e.to_string());
        assert!(err.as_deref().is_some_and(|e| e.contains("`version_group`")), "{err:?}");
    }

    #[test]
    fn bad_fields_are_named() {
        let base = || FileConfig { version_group: Some("g1".into()), ..FileConfig::default() };
        let cases = [
            (FileConfig { kv_dtype: Some("bf8".into()), ..base() }, "`kv_dtype`"),
            (FileConfig { kv_blocks: Some(0), ..base() }, "`kv_blocks`"),
            (FileConfig { grpc: Some("nowhere".into()), ..base() }, "`grpc`"),
            (FileConfig { metrics: Some("localhost".into()), ..base() }, "`metrics`"),
            (FileConfig { version_group: Some("a b".into()), ..base() }, "`version_group`"),
        ];
        for (f, field) in cases {
            let err = Config::resolve(with_model(f)).err().map(|e| e.to_string());
            assert!(err.as_deref().is_some_and(|e| e.contains(field)), "{field}: {err:?}");
        }
    }

    #[test]
    fn file_then_flags_override_defaults() {
        let dir = std::env::temp_dir().join(format!("tandem-pw-cfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok();
        let path = dir.join("c.toml");
        let model = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
        let text = format!(
            "version_group = \"file-g\"\nkv_blocks = 7\nmax_waiting = 3\nmetrics = \"127.0.0.1:9464\"\nmodel = {:?}\n",
            model
        );
        std::fs::write(&path, text).ok();
        let flags = Flags { config: Some(path.clone()), kv_blocks: Some(9), ..Flags::default() };
        let cfg = Config::load(&flags).map_err(|e| e.to_string());
        let cfg = match cfg {
            Ok(c) => c,
            Err(e) => panic!("config did not load: {e}"),
        };
        assert_eq!((cfg.kv_blocks, cfg.max_waiting, cfg.kv_block_size), (9, 3, 16));
        assert_eq!(cfg.version_group.as_str(), "file-g");
        assert_eq!(cfg.metrics, SocketAddr::from(([127, 0, 0, 1], 9464)));
        std::fs::write(&path, "kv_blokcs = 1\n").ok();
        let err = Config::load(&Flags { config: Some(path), ..Flags::default() }).err().map(|e| e.to_string());
        assert!(err.as_deref().is_some_and(|e| e.contains("kv_blokcs")), "{err:?}");
    }
}
