//! The tenants file: who may call (API keys) and, per tenant, what it may
//! use. Parsed and validated as a whole: a file with one bad value is
//! refused, naming the file and the key, and nothing of it is used.
//!
//! ```toml
//! [defaults]                    # optional: what a tenant gets for a field it does not set
//! requests_per_s = 20
//!
//! [tenants.search]
//! keys = ["sk-search-1", "sk-search-2"]
//! priority = "high"
//! output_tokens_per_min = 600000
//! max_tokens = 1024
//! cache_scope = "shared:docs"   # or "tenant" (the default)
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use thiserror::Error;

use crate::auth::{ApiKeys, KeysError};
use types::priority::Priority;

/// Why a tenants file was refused.
#[derive(Debug, Error)]
pub enum TenantsError {
    /// The file could not be read.
    #[error("reading the tenants file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    /// The file is not TOML of the expected shape (unknown keys included).
    #[error("tenants file {path}: {message}")]
    Parse { path: String, message: String },
    /// A value is out of range; `key` names it (`tenants.search.max_tokens`).
    #[error("tenants file {path}: {key}: {why}")]
    Invalid { path: String, key: String, why: String },
    /// The keys do not form a valid key set (a key used twice, an empty key).
    #[error("tenants file {path}: {source}")]
    Keys { path: String, source: KeysError },
}

/// Where a tenant's prefix-cache entries live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheScope {
    /// Its own: no other tenant can hit (or time) its cached prefixes.
    Tenant,
    /// A named pool shared by every tenant that names it.
    Shared(String),
}

impl CacheScope {
    fn parse(s: &str) -> Option<Self> {
        if s == "tenant" {
            return Some(Self::Tenant);
        }
        let pool = s.strip_prefix("shared:")?;
        valid_name(pool).then(|| Self::Shared(pool.to_owned()))
    }

    /// The salt a request's prefix-cache hashes are mixed with: equal for
    /// equal scopes, different (as far as a 64-bit hash tells) otherwise,
    /// never 0 (the workers' unsalted cache).
    pub fn salt(&self, tenant: &str) -> u64 {
        let h = match self {
            Self::Tenant => fnv1a(&[b"tenant:", tenant.as_bytes()]),
            Self::Shared(pool) => fnv1a(&[b"shared:", pool.as_bytes()]),
        };
        h.max(1)
    }

    /// The scope as metrics label it: `tenant:NAME` or `shared:POOL`.
    pub fn label(&self, tenant: &str) -> String {
        match self {
            Self::Tenant => format!("tenant:{tenant}"),
            Self::Shared(p) => format!("shared:{p}"),
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Self::Tenant => "tenant".into(),
            Self::Shared(p) => format!("shared:{p}"),
        }
    }
}

/// FNV-1a, 64 bits, over the concatenated parts.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parts.iter().flat_map(|p| p.iter()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// One tenant's limits, each a whole-fleet budget (see [`super::Tenancy`] for
/// how it is split between coordinators).
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// Requests per second (the bucket holds one second's worth, at least
    /// [`super::MIN_REQUEST_BURST`]).
    pub requests_per_s: f64,
    /// Prompt tokens per minute (the bucket holds one minute's worth).
    pub prompt_tokens_per_min: u64,
    /// Output tokens per minute, charged as `max_tokens` when a request is
    /// admitted and the unused part given back when it ends.
    pub output_tokens_per_min: u64,
    /// Largest prompt, tokens (413 `prompt_too_long` beyond).
    pub max_prompt_tokens: u32,
    /// Largest `max_tokens` a request may ask for (400 `max_tokens_too_large` beyond).
    pub max_tokens: u32,
    /// `max_tokens` of a request that sets none; `None`: `--default-max-tokens`.
    pub default_max_tokens: Option<u32>,
    /// Requests admitted and not yet answered (429 `too_many_in_flight` beyond).
    pub max_in_flight: u32,
    /// Streamed answers open at once (429 `too_many_streams` beyond).
    pub max_streams: u32,
    /// Largest fraction of the cluster's KV cache the tenant's requests may
    /// hold, counted by the coordinators as prompt plus `max_tokens` of each
    /// request admitted and not yet ended (429 `kv_share` beyond; see
    /// [`super::Pass::hold_kv`]). 1 (the default) counts nothing.
    pub max_kv_share: f64,
}

impl Default for Limits {
    /// The documented defaults: finite, and generous enough that a tenant
    /// configured with nothing else is limited by the cluster first.
    fn default() -> Self {
        Self {
            requests_per_s: 1000.0,
            prompt_tokens_per_min: 6_000_000,
            output_tokens_per_min: 6_000_000,
            max_prompt_tokens: 32_768,
            max_tokens: 32_768,
            default_max_tokens: None,
            max_in_flight: 1024,
            max_streams: 1024,
            max_kv_share: 1.0,
        }
    }
}

/// A tenant: its name (what logs, metrics and fairness use), class and limits.
#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    pub name: String,
    /// The class of its requests that ask for none.
    pub priority: Priority,
    /// The highest class its requests may ask for; a higher ask is lowered to it.
    pub max_priority: Priority,
    pub limits: Limits,
    pub cache_scope: CacheScope,
    /// [`CacheScope::salt`] of its scope, sent to the workers.
    pub cache_salt: u64,
    /// Its requests may use prompt-lookup speculation where workers run it
    /// (a request can still turn it off; with `false` none can turn it on).
    pub prompt_lookup: bool,
}

impl Tenant {
    /// The tenant every caller belongs to when no tenants file is given:
    /// [`Limits::default`], normal class, and any class on request (as
    /// before tenants existed).
    pub fn builtin() -> Self {
        let scope = CacheScope::Tenant;
        Self {
            name: DEFAULT_TENANT.into(),
            priority: Priority::Normal,
            max_priority: Priority::High,
            limits: Limits::default(),
            cache_salt: scope.salt(DEFAULT_TENANT),
            cache_scope: scope,
            prompt_lookup: true,
        }
    }

    /// The class a request runs at: its ask (else the tenant's class),
    /// never above `max_priority` (`High` ranks first, so "above" is "less").
    pub fn class_of(&self, asked: Option<Priority>) -> Priority {
        asked.unwrap_or(self.priority).max(self.max_priority)
    }
}

/// The name of the built-in tenant (no tenants file).
pub const DEFAULT_TENANT: &str = "default";

/// A parsed tenants file.
#[derive(Debug, Clone)]
pub struct TenantsFile {
    pub keys: ApiKeys,
    pub tenants: BTreeMap<String, Tenant>,
}

#[derive(Debug, Default, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Fields {
    keys: Option<Vec<String>>,
    priority: Option<String>,
    max_priority: Option<String>,
    requests_per_s: Option<f64>,
    prompt_tokens_per_min: Option<u64>,
    output_tokens_per_min: Option<u64>,
    max_prompt_tokens: Option<u32>,
    max_tokens: Option<u32>,
    default_max_tokens: Option<u32>,
    max_in_flight: Option<u32>,
    max_streams: Option<u32>,
    max_kv_share: Option<f64>,
    cache_scope: Option<String>,
    prompt_lookup: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Doc {
    #[serde(default)]
    defaults: Fields,
    #[serde(default)]
    tenants: BTreeMap<String, Fields>,
}

/// Tenant and pool names: what may appear as a metric label.
fn valid_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl TenantsFile {
    /// Reads and validates `path`.
    pub fn load(path: &Path) -> Result<Self, TenantsError> {
        let shown = path.display().to_string();
        let text =
            std::fs::read_to_string(path).map_err(|source| TenantsError::Read { path: shown.clone(), source })?;
        Self::parse(&shown, &text)
    }

    /// Validates the text of a tenants file (`path` is only for messages).
    pub fn parse(path: &str, text: &str) -> Result<Self, TenantsError> {
        // The message and line only: toml's own rendering quotes the source
        // line, which may hold a key.
        let doc: Doc = toml::from_str(text).map_err(|e| {
            let line = e.span().map_or(0, |s| text[..s.start.min(text.len())].matches('\n').count() + 1);
            TenantsError::Parse { path: path.into(), message: format!("line {line}: {}", e.message().trim()) }
        })?;
        let invalid = |key: String, why: &str| TenantsError::Invalid { path: path.into(), key, why: why.to_owned() };
        if doc.defaults.keys.is_some() {
            return Err(invalid("defaults.keys".into(), "keys belong to a tenant, not to [defaults]"));
        }
        if doc.tenants.is_empty() {
            return Err(invalid("tenants".into(), "no tenant is configured: every request would be refused"));
        }
        let mut pairs = Vec::new();
        let mut tenants = BTreeMap::new();
        for (name, own) in &doc.tenants {
            if !valid_name(name) {
                return Err(invalid(
                    format!("tenants.{name}"),
                    "a tenant name is 1 to 64 of A-Z a-z 0-9 . _ - (it is a metric label)",
                ));
            }
            let tenant = resolve(name, own, &doc.defaults).map_err(|(field, why)| {
                let from = if own_has(own, field) { format!("tenants.{name}") } else { "defaults".into() };
                invalid(format!("{from}.{field}"), &why)
            })?;
            let keys = own.keys.clone().unwrap_or_default();
            if keys.is_empty() {
                return Err(invalid(format!("tenants.{name}.keys"), "a tenant needs at least one API key"));
            }
            pairs.extend(keys.into_iter().map(|k| (k, name.clone())));
            tenants.insert(name.clone(), tenant);
        }
        let keys = ApiKeys::from_pairs(pairs).map_err(|source| TenantsError::Keys { path: path.into(), source })?;
        Ok(Self { keys, tenants })
    }
}

/// Whether the tenant's own table sets `field` (so an error names it there).
fn own_has(own: &Fields, field: &str) -> bool {
    match field {
        "priority" => own.priority.is_some(),
        "max_priority" => own.max_priority.is_some(),
        "requests_per_s" => own.requests_per_s.is_some(),
        "prompt_tokens_per_min" => own.prompt_tokens_per_min.is_some(),
        "output_tokens_per_min" => own.output_tokens_per_min.is_some(),
        "max_prompt_tokens" => own.max_prompt_tokens.is_some(),
        "max_tokens" => own.max_tokens.is_some(),
        "default_max_tokens" => own.default_max_tokens.is_some(),
        "max_in_flight" => own.max_in_flight.is_some(),
        "max_streams" => own.max_streams.is_some(),
        "max_kv_share" => own.max_kv_share.is_some(),
        "cache_scope" => own.cache_scope.is_some(),
        "prompt_lookup" => own.prompt_lookup.is_some(),
        _ => true,
    }
}

/// One tenant from its own fields over `[defaults]` over [`Limits::default`];
/// an error is (field, why).
fn resolve(name: &str, own: &Fields, defaults: &Fields) -> Result<Tenant, (&'static str, String)> {
    macro_rules! pick {
        ($f:ident) => {
            own.$f.clone().or_else(|| defaults.$f.clone())
        };
    }
    let base = Limits::default();
    let class = |field: &'static str, v: Option<String>| -> Result<Option<Priority>, (&'static str, String)> {
        v.map(|s| Priority::parse(&s).map_err(|e| (field, e.to_string()))).transpose()
    };
    let priority = class("priority", pick!(priority))?.unwrap_or(Priority::Normal);
    let max_priority = class("max_priority", pick!(max_priority))?.unwrap_or(priority);
    if priority < max_priority {
        return Err((
            "max_priority",
            format!("is below priority ({priority}): the tenant's own class must be allowed"),
        ));
    }
    let limits = Limits {
        requests_per_s: pick!(requests_per_s).unwrap_or(base.requests_per_s),
        prompt_tokens_per_min: pick!(prompt_tokens_per_min).unwrap_or(base.prompt_tokens_per_min),
        output_tokens_per_min: pick!(output_tokens_per_min).unwrap_or(base.output_tokens_per_min),
        max_prompt_tokens: pick!(max_prompt_tokens).unwrap_or(base.max_prompt_tokens),
        max_tokens: pick!(max_tokens).unwrap_or(base.max_tokens),
        default_max_tokens: pick!(default_max_tokens),
        max_in_flight: pick!(max_in_flight).unwrap_or(base.max_in_flight),
        max_streams: pick!(max_streams).unwrap_or(base.max_streams),
        max_kv_share: pick!(max_kv_share).unwrap_or(base.max_kv_share),
    };
    if !(limits.requests_per_s.is_finite() && limits.requests_per_s > 0.0) {
        return Err(("requests_per_s", "must be a number above 0 (there is no unlimited)".into()));
    }
    for (field, v) in [
        ("prompt_tokens_per_min", limits.prompt_tokens_per_min),
        ("output_tokens_per_min", limits.output_tokens_per_min),
        ("max_prompt_tokens", u64::from(limits.max_prompt_tokens)),
        ("max_tokens", u64::from(limits.max_tokens)),
        ("max_in_flight", u64::from(limits.max_in_flight)),
        ("max_streams", u64::from(limits.max_streams)),
    ] {
        if v == 0 {
            return Err((field, "must be at least 1".into()));
        }
    }
    if let Some(d) = limits.default_max_tokens {
        if d == 0 || d > limits.max_tokens {
            return Err(("default_max_tokens", format!("must be in 1..={} (max_tokens)", limits.max_tokens)));
        }
    }
    if !(limits.max_kv_share.is_finite() && limits.max_kv_share > 0.0 && limits.max_kv_share <= 1.0) {
        return Err(("max_kv_share", "must be a fraction in (0, 1]".into()));
    }
    let scope = match pick!(cache_scope) {
        None => CacheScope::Tenant,
        Some(s) => CacheScope::parse(&s)
            .ok_or(("cache_scope", format!("{s:?}: must be \"tenant\" or \"shared:POOL\" (POOL as a tenant name)")))?,
    };
    Ok(Tenant {
        name: name.to_owned(),
        priority,
        max_priority,
        limits,
        cache_salt: scope.salt(name),
        cache_scope: scope,
        prompt_lookup: pick!(prompt_lookup).unwrap_or(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
        [defaults]
        requests_per_s = 5
        max_tokens = 512

        [tenants.search]
        keys = ["sk-s1", "sk-s2"]
        priority = "high"
        max_tokens = 1024
        default_max_tokens = 64
        cache_scope = "shared:docs"

        [tenants.batch]
        keys = ["sk-b"]
        prompt_lookup = false
        priority = "low"
        max_in_flight = 2
        max_streams = 1
    "#;

    #[test]
    fn a_file_resolves_own_fields_over_defaults_over_builtins() {
        let f = TenantsFile::parse("t.toml", GOOD).expect("valid");
        assert_eq!(f.keys.len(), 3);
        assert_eq!(f.keys.caller_of("sk-s2"), Some("search"));
        assert_eq!(f.keys.caller_of("sk-b"), Some("batch"));
        assert_eq!(f.keys.caller_of("sk-x"), None);
        let s = &f.tenants["search"];
        assert_eq!((s.priority, s.max_priority), (Priority::High, Priority::High));
        assert_eq!(s.limits.requests_per_s, 5.0, "from [defaults]");
        assert!(s.prompt_lookup && !f.tenants["batch"].prompt_lookup && Tenant::builtin().prompt_lookup);
        assert_eq!(s.limits.max_tokens, 1024, "its own over [defaults]");
        assert_eq!(s.limits.default_max_tokens, Some(64));
        assert_eq!(s.limits.max_streams, Limits::default().max_streams, "built-in");
        let b = &f.tenants["batch"];
        assert_eq!((b.limits.max_in_flight, b.limits.max_streams, b.limits.max_tokens), (2, 1, 512));
        assert_eq!(b.class_of(None), Priority::Low);
        assert_eq!(b.class_of(Some(Priority::High)), Priority::Low, "no climbing above its class");
        assert_eq!(s.class_of(Some(Priority::Low)), Priority::Low, "a lower ask is honoured");
        assert!(!format!("{:?}", f.keys).contains("sk-"), "keys never show");
    }

    #[test]
    fn the_example_file_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/tenants.example.toml");
        let f = TenantsFile::load(&path).expect("config/tenants.example.toml validates");
        assert_eq!(f.tenants["search"].cache_salt, f.tenants["assistant"].cache_salt, "one shared pool");
        assert_eq!(f.tenants["assistant"].class_of(Some(Priority::High)), Priority::High);
        // The Kubernetes pack's Secret holds this one.
        let pack = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/k8s/overlays/example/tenants.toml");
        let f = TenantsFile::load(&pack).expect("the pack's tenants.toml validates");
        assert!(f.tenants.contains_key("default"), "the pack's one tenant");
    }

    #[test]
    fn cache_salts_separate_tenants_and_join_a_shared_pool() {
        let text = format!("{GOOD}\n[tenants.docs2]\nkeys=[\"sk-d\"]\ncache_scope = \"shared:docs\"\n");
        let f = TenantsFile::parse("t.toml", &text).expect("valid");
        let salt = |t: &str| f.tenants[t].cache_salt;
        assert_eq!(salt("search"), salt("docs2"), "one pool, one salt");
        assert_ne!(salt("search"), salt("batch"));
        assert_ne!(CacheScope::Tenant.salt("a"), CacheScope::Tenant.salt("b"));
        assert_ne!(CacheScope::Tenant.salt("docs"), CacheScope::Shared("docs".into()).salt("x"));
        assert!(f.tenants.values().all(|t| t.cache_salt != 0));
    }

    #[test]
    fn bad_files_are_refused_naming_the_key() {
        let cases: &[(&str, &str)] = &[
            ("[tenants.a]\nkeys=[\"k\"]\nmax_tokens = 0\n", "tenants.a.max_tokens"),
            ("[defaults]\nrequests_per_s = 0\n[tenants.a]\nkeys=[\"k\"]\n", "defaults.requests_per_s"),
            ("[tenants.a]\nkeys=[\"k\"]\nrequests_per_s = -1\n", "tenants.a.requests_per_s"),
            ("[tenants.a]\nkeys=[\"k\"]\npriority = \"urgent\"\n", "tenants.a.priority"),
            ("[tenants.a]\nkeys=[\"k\"]\npriority=\"low\"\nmax_priority=\"high\"\n", ""),
            ("[tenants.a]\nkeys=[\"k\"]\nmax_priority=\"low\"\npriority=\"high\"\n", "tenants.a.max_priority"),
            ("[tenants.a]\nkeys=[\"k\"]\nmax_kv_share = 1.5\n", "tenants.a.max_kv_share"),
            ("[tenants.a]\nkeys=[\"k\"]\ncache_scope = \"global\"\n", "tenants.a.cache_scope"),
            ("[tenants.a]\nkeys=[\"k\"]\nmax_tokens=8\ndefault_max_tokens=9\n", "tenants.a.default_max_tokens"),
            ("[tenants.a]\nkeys=[]\n", "tenants.a.keys"),
            ("[tenants.\"a b\"]\nkeys=[\"k\"]\n", "tenants.a b"),
            ("[tenants.a]\nkeys=[\"k\"]\n[tenants.b]\nkeys=[\"k\"]\n", "the same API key"),
            ("[tenants.a]\nkeys=[\"k\"]\nmax_tokenz = 3\n", "unknown field"),
            ("[defaults]\nkeys=[\"k\"]\n[tenants.a]\nkeys=[\"j\"]\n", "defaults.keys"),
            ("", "no tenant"),
            ("[tenants.a\n", "t.toml"),
        ];
        let e = TenantsFile::parse("t.toml", "[tenants.a]\nkeys = [\"sk-secret\" \"x\"]\n").expect_err("bad TOML");
        assert!(!e.to_string().contains("sk-secret"), "a key is never echoed: {e}");
        for (text, names) in cases {
            match TenantsFile::parse("t.toml", text) {
                Ok(_) if names.is_empty() => {}
                Ok(_) => panic!("accepted: {text}"),
                Err(e) => {
                    let msg = e.to_string();
                    assert!(msg.contains("t.toml") && msg.contains(names), "{text:?}: {msg}");
                    assert!(!msg.contains("\"k\""), "a key is never echoed: {msg}");
                }
            }
        }
    }
}
