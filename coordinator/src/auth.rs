//! API keys: who is calling.
//!
//! With no key configured every request is the caller `anonymous`. With
//! keys (`--api-key KEY`, repeatable, and/or `--api-keys-file PATH`), every
//! route except `/health`, `/ready` and `/metrics` (HTTP) and the standard
//! health service (gRPC) needs one, as `Authorization: Bearer KEY` (what
//! OpenAI clients send) or `x-api-key: KEY`; a missing or wrong key is
//! refused with `invalid_api_key` (HTTP 401, gRPC `UNAUTHENTICATED`).
//!
//! The caller's *name* — never the key itself — is what admission uses for
//! per-caller limits and fairness, what scopes idempotency keys, and what
//! may appear in logs. The keys file has one key per line, optionally
//! followed by whitespace and a name (`sk-abc123 team-search`); blank lines
//! and lines starting with `#` are skipped. A key without a name is named
//! `key-N` by its position (flags first, then file lines).
//!
//! Must not: log or echo a key, or compare keys in time that depends on
//! where they differ.

use std::path::Path;

use axum::http::{header, HeaderMap};

use crate::error::Error;

/// The caller of a request without configured keys.
pub const ANONYMOUS: &str = "anonymous";

/// The configured keys, each with its caller name.
#[derive(Clone, Default)]
pub struct ApiKeys {
    keys: Vec<(Vec<u8>, String)>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names only: keys never reach logs.
        f.debug_list().entries(self.keys.iter().map(|(_, n)| n)).finish()
    }
}

/// Why the keys could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("reading the API keys file {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("API keys file {path}, line {line}: {why}")]
    Line { path: String, line: usize, why: &'static str },
    #[error("API key #{0} is empty")]
    Empty(usize),
    #[error("API key name {0:?} is used twice")]
    DuplicateName(String),
    #[error("the same API key is configured twice (as {0:?} and {1:?})")]
    DuplicateKey(String, String),
}

impl ApiKeys {
    /// Keys from flags, then from the file.
    pub fn load(flag_keys: &[String], file: Option<&Path>) -> Result<Self, KeysError> {
        let mut keys = Self::default();
        for (i, k) in flag_keys.iter().enumerate() {
            if k.trim().is_empty() {
                return Err(KeysError::Empty(i + 1));
            }
            let n = keys.keys.len() + 1;
            keys.add(k.trim(), format!("key-{n}"))?;
        }
        if let Some(path) = file {
            let shown = path.display().to_string();
            let text =
                std::fs::read_to_string(path).map_err(|source| KeysError::Read { path: shown.clone(), source })?;
            for (i, line) in text.lines().enumerate() {
                let line = line.trim();
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                let mut parts = line.split_whitespace();
                let key = parts.next().unwrap_or_default();
                let n = keys.keys.len() + 1;
                let name = parts.next().map_or_else(|| format!("key-{n}"), str::to_owned);
                if parts.next().is_some() {
                    return Err(KeysError::Line { path: shown, line: i + 1, why: "expected `KEY [NAME]`" });
                }
                keys.add(key, name)?;
            }
        }
        Ok(keys)
    }

    /// Keys from (key, caller) pairs, where several keys may name one caller
    /// (a tenant's keys, from the tenants file).
    pub fn from_pairs(pairs: impl IntoIterator<Item = (String, String)>) -> Result<Self, KeysError> {
        let mut keys = Self::default();
        for (i, (key, name)) in pairs.into_iter().enumerate() {
            let key = key.trim();
            if key.is_empty() {
                return Err(KeysError::Empty(i + 1));
            }
            if let Some((_, other)) = keys.keys.iter().find(|(k, _)| equal(k, key.as_bytes())) {
                return Err(KeysError::DuplicateKey(other.clone(), name));
            }
            keys.keys.push((key.as_bytes().to_vec(), name));
        }
        Ok(keys)
    }

    fn add(&mut self, key: &str, name: String) -> Result<(), KeysError> {
        if let Some((_, other)) = self.keys.iter().find(|(_, n)| *n == name) {
            return Err(KeysError::DuplicateName(other.clone()));
        }
        if let Some((_, other)) = self.keys.iter().find(|(k, _)| equal(k, key.as_bytes())) {
            return Err(KeysError::DuplicateKey(other.clone(), name));
        }
        self.keys.push((key.as_bytes().to_vec(), name));
        Ok(())
    }

    /// Whether keys are required.
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// How many keys are configured.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Whether none is configured.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The caller named by `presented` (the raw key), or `None`.
    pub fn caller_of(&self, presented: &str) -> Option<&str> {
        if !self.enabled() {
            return Some(ANONYMOUS);
        }
        // Compare with every key, so the time taken does not say which matched.
        let mut found = None;
        for (k, name) in &self.keys {
            if equal(k, presented.as_bytes()) && found.is_none() {
                found = Some(name.as_str());
            }
        }
        found
    }

    /// The caller of a request (HTTP headers, or gRPC metadata as headers),
    /// or why it has none.
    pub fn check(&self, headers: &HeaderMap) -> Result<String, Error> {
        if !self.enabled() {
            return Ok(ANONYMOUS.to_owned());
        }
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")));
        let presented = bearer.or_else(|| headers.get("x-api-key").and_then(|v| v.to_str().ok()));
        let Some(presented) = presented else {
            return Err(Error::MissingApiKey);
        };
        self.caller_of(presented.trim()).map(str::to_owned).ok_or(Error::WrongApiKey)
    }
}

/// Constant-time for equal lengths; lengths are not secret.
fn equal(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_str(v).expect("a header value"));
        }
        h
    }

    #[test]
    fn without_keys_everyone_is_anonymous() {
        let k = ApiKeys::load(&[], None).expect("no keys");
        assert_eq!(k.check(&HeaderMap::new()).expect("open"), ANONYMOUS);
    }

    #[test]
    fn keys_from_flags_and_file_name_their_callers() {
        let dir = std::env::temp_dir().join(format!("tandem-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let file = dir.join("keys");
        std::fs::write(&file, "# team keys\n\nsk-search search\nsk-anon\n").expect("write");
        let k = ApiKeys::load(&["sk-flag".into()], Some(&file)).expect("keys");
        assert_eq!(k.len(), 3);
        assert_eq!(k.check(&headers(&[("authorization", "Bearer sk-flag")])).expect("ok"), "key-1");
        assert_eq!(k.check(&headers(&[("authorization", "Bearer sk-search")])).expect("ok"), "search");
        assert_eq!(k.check(&headers(&[("x-api-key", "sk-anon")])).expect("ok"), "key-3");
        let e = k.check(&headers(&[("authorization", "Bearer sk-nope")])).expect_err("wrong key");
        assert_eq!(e, Error::WrongApiKey);
        assert!(!e.to_string().contains("sk-nope"), "a key is never echoed");
        assert_eq!(k.check(&HeaderMap::new()), Err(Error::MissingApiKey));
        assert!(k.check(&headers(&[("authorization", "Basic sk-flag")])).is_err());
        assert!(!format!("{k:?}").contains("sk-"), "Debug shows names only");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn bad_key_files_are_refused_with_the_line() {
        let dir = std::env::temp_dir().join(format!("tandem-badkeys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let file = dir.join("keys");
        std::fs::write(&file, "sk-a a\nsk-b b extra\n").expect("write");
        let e = ApiKeys::load(&[], Some(&file)).expect_err("three fields");
        assert!(e.to_string().contains("line 2"), "{e}");
        std::fs::write(&file, "sk-a a\nsk-a b\n").expect("write");
        assert!(matches!(ApiKeys::load(&[], Some(&file)), Err(KeysError::DuplicateKey(..))));
        std::fs::write(&file, "sk-a a\nsk-b a\n").expect("write");
        assert!(matches!(ApiKeys::load(&[], Some(&file)), Err(KeysError::DuplicateName(_))));
        assert!(matches!(ApiKeys::load(&[], Some(&dir.join("missing"))), Err(KeysError::Read { .. })));
        assert!(matches!(ApiKeys::load(&[" ".into()], None), Err(KeysError::Empty(1))));
        std::fs::remove_dir_all(&dir).ok();
    }
}
