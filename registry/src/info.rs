//! What a worker publishes about itself: [`WorkerInfo`], stored as JSON in etcd.
//!
//! Fields are added with `#[serde(default)]` and unknown fields are ignored, so a
//! coordinator reads values written by older and newer workers alike. Load (queue depth,
//! KV headroom) is deliberately absent: it changes per request and reaches coordinators
//! straight from the workers, never through etcd writes.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::RegistryError;

/// Longest worker id, version group or address accepted.
const MAX_LABEL: usize = 256;
/// Longest transfer address: a UCX worker address, hex-encoded, runs to a
/// few hundred bytes per transport and NIC it lists.
const MAX_TRANSFER_ADDR: usize = 8192;

/// What a worker does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Turns prompts into KV cache and pushes it to decode workers.
    Prefill,
    /// Receives KV, runs continuous-batching decode and streams tokens.
    Decode,
}

impl Role {
    /// Both roles, in key order.
    pub const ALL: [Role; 2] = [Role::Prefill, Role::Decode];

    /// The name used in keys and JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = RegistryError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            other => Err(RegistryError::invalid("role", format!("{other:?} is not prefill or decode"))),
        }
    }
}

/// Where a decode worker receives KV pushes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransferEndpoint {
    /// `host:port` (a socket path for the `local` transport, the UCX worker
    /// address in hex for `ucx`).
    pub addr: String,
    /// The transport's name as the workers' `--kv-transport` spells it (`tcp`, `quic`, `local`, ...).
    pub transport: String,
    /// For QUIC with a self-signed certificate: its SHA-256 fingerprint in hex, for prefill
    /// workers to pin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_sha256: Option<String>,
}

/// Static capacity; live load travels outside etcd.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    /// KV blocks in the worker's pool.
    pub kv_blocks_total: u64,
    /// Most sequences the worker runs at once.
    pub max_running: u32,
}

/// One worker's registration, the value under `/{prefix}/workers/{role}/{id}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// Unique among workers of its role in the cluster: `[A-Za-z0-9._-]`, at most 256 bytes.
    pub id: String,
    /// Prefill or decode.
    pub role: Role,
    /// Only workers with equal version groups are paired.
    pub version_group: String,
    /// The `KvLayout` fingerprint in hex; the transfer handshake checks it again.
    pub layout_fingerprint: String,
    /// The determinism fingerprint in hex (sampler version, kernel numerics class, layout):
    /// a request moves mid-stream only between workers with equal ones. Empty from
    /// workers older than the field, which are never chosen for a continuation.
    #[serde(default)]
    pub determinism_fingerprint: String,
    /// The worker's gRPC service, `host:port`.
    pub grpc_addr: String,
    /// Where KV is pushed to; required for decode workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transfer: Option<TransferEndpoint>,
    /// The worker's Prometheus endpoint, `host:port`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_addr: Option<String>,
    /// The zone it runs in (the node's `topology.kubernetes.io/zone`, a rack):
    /// coordinators with `--zone-pairing` keep KV inside one. Empty: none given.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub zone: String,
    /// Static capacity.
    #[serde(default)]
    pub capacity: Capacity,
    /// A draining worker finishes what it has and takes nothing new.
    #[serde(default)]
    pub draining: bool,
    /// Wall-clock start time in Unix milliseconds; for display only, never for timing.
    #[serde(default)]
    pub started_at_unix_ms: u64,
}

impl WorkerInfo {
    /// Milliseconds since the Unix epoch now, for [`WorkerInfo::started_at_unix_ms`].
    pub fn unix_ms_now() -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0)
    }

    /// Checks every field; the error names the first bad one.
    pub fn validate(&self) -> Result<(), RegistryError> {
        check_name("info.id", &self.id)?;
        check_label("info.version_group", &self.version_group)?;
        check_hex("info.layout_fingerprint", &self.layout_fingerprint)?;
        if !self.determinism_fingerprint.is_empty() {
            check_hex("info.determinism_fingerprint", &self.determinism_fingerprint)?;
        }
        check_label("info.grpc_addr", &self.grpc_addr)?;
        check_zone(&self.zone)?;
        if let Some(m) = &self.metrics_addr {
            check_label("info.metrics_addr", m)?;
        }
        match (&self.transfer, self.role) {
            (None, Role::Decode) => {
                return Err(RegistryError::invalid("info.transfer", "a decode worker needs a transfer endpoint"));
            }
            (Some(t), _) => {
                check_text("info.transfer.addr", &t.addr, MAX_TRANSFER_ADDR)?;
                check_name("info.transfer.transport", &t.transport)?;
                if let Some(fp) = &t.cert_sha256 {
                    check_hex("info.transfer.cert_sha256", fp)?;
                }
            }
            (None, Role::Prefill) => {}
        }
        Ok(())
    }
}

/// A key segment: non-empty, `[A-Za-z0-9._-]`, at most 256 bytes, not `.` or `..`.
pub(crate) fn check_name(field: &'static str, s: &str) -> Result<(), RegistryError> {
    if s.is_empty() || s.len() > MAX_LABEL {
        return Err(RegistryError::invalid(field, format!("must be 1..={MAX_LABEL} bytes")));
    }
    if s == "." || s == ".." {
        return Err(RegistryError::invalid(field, "must not be . or .."));
    }
    if let Some(c) = s.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))) {
        return Err(RegistryError::invalid(field, format!("{c:?} is not one of [A-Za-z0-9._-]")));
    }
    Ok(())
}

/// A worker's zone ([`WorkerInfo::zone`]): empty (none given), or a label of
/// 1..=256 bytes without whitespace or control characters. Workers check their
/// `--zone` with it at start.
pub fn check_zone(zone: &str) -> Result<(), RegistryError> {
    if zone.is_empty() {
        return Ok(());
    }
    check_label("info.zone", zone)
}

fn check_label(field: &'static str, s: &str) -> Result<(), RegistryError> {
    check_text(field, s, MAX_LABEL)
}

fn check_text(field: &'static str, s: &str, max: usize) -> Result<(), RegistryError> {
    if s.is_empty() || s.len() > max {
        return Err(RegistryError::invalid(field, format!("must be 1..={max} bytes")));
    }
    if s.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(RegistryError::invalid(field, "must not contain whitespace or control characters"));
    }
    Ok(())
}

fn check_hex(field: &'static str, s: &str) -> Result<(), RegistryError> {
    if s.is_empty() || s.len() % 2 != 0 || s.len() > MAX_LABEL || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(RegistryError::invalid(field, "must be a non-empty even-length hex string"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode() -> WorkerInfo {
        WorkerInfo {
            id: "d0".into(),
            role: Role::Decode,
            version_group: "g1".into(),
            layout_fingerprint: "ab01".into(),
            grpc_addr: "127.0.0.1:1".into(),
            transfer: Some(TransferEndpoint { addr: "127.0.0.1:2".into(), transport: "tcp".into(), cert_sha256: None }),
            metrics_addr: None,
            capacity: Capacity { kv_blocks_total: 10, max_running: 4 },
            draining: false,
            started_at_unix_ms: 1,
            determinism_fingerprint: String::new(),
            zone: String::new(),
        }
    }

    #[test]
    fn json_round_trip_and_unknown_fields() {
        let info = decode();
        let json = serde_json::to_string(&info).expect("encode");
        assert!(json.contains(r#""role":"decode""#), "{json}");
        assert_eq!(serde_json::from_str::<WorkerInfo>(&json).expect("decode"), info);
        let newer = json.replacen('{', r#"{"future_field":[1,2],"#, 1);
        assert_eq!(serde_json::from_str::<WorkerInfo>(&newer).expect("newer value"), info);
    }

    #[test]
    fn validation_names_the_field() {
        assert!(decode().validate().is_ok());
        type Mutation = Box<dyn Fn(&mut WorkerInfo)>;
        let cases: Vec<(&str, Mutation)> = vec![
            ("info.id", Box::new(|i| i.id = "a/b".into())),
            ("info.id", Box::new(|i| i.id = "..".into())),
            ("info.version_group", Box::new(|i| i.version_group.clear())),
            ("info.layout_fingerprint", Box::new(|i| i.layout_fingerprint = "xyz1".into())),
            ("info.grpc_addr", Box::new(|i| i.grpc_addr = "a b".into())),
            ("info.transfer", Box::new(|i| i.transfer = None)),
            ("info.transfer.transport", Box::new(|i| i.transfer.as_mut().expect("set").transport = "t/x".into())),
            ("info.zone", Box::new(|i| i.zone = "eu west".into())),
        ];
        for (field, mutate) in cases {
            let mut info = decode();
            mutate(&mut info);
            match info.validate() {
                Err(RegistryError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: expected Invalid, got {other:?}"),
            }
        }
        let prefill = WorkerInfo { role: Role::Prefill, transfer: None, ..decode() };
        assert!(prefill.validate().is_ok());
        let zoned = WorkerInfo { zone: "europe-west4-a".into(), ..decode() };
        assert!(zoned.validate().is_ok());
    }

    #[test]
    fn the_zone_is_left_out_when_none_was_given() {
        // A registration without a zone reads the same to a coordinator older than the field.
        let json = serde_json::to_string(&decode()).expect("encode");
        assert!(!json.contains("zone"), "{json}");
        let zoned = WorkerInfo { zone: "rack-7".into(), ..decode() };
        let json = serde_json::to_string(&zoned).expect("encode");
        assert!(json.contains(r#""zone":"rack-7""#), "{json}");
        assert_eq!(serde_json::from_str::<WorkerInfo>(&json).expect("decode"), zoned);
    }

    #[test]
    fn role_parses() {
        for r in Role::ALL {
            assert_eq!(r.as_str().parse::<Role>().expect("parse"), r);
        }
        assert!("Decode".parse::<Role>().is_err());
    }
}
