//! The key layout, in one place.
//!
//! ```text
//! /{prefix}/workers/{role}/{id}   -> WorkerInfo JSON, attached to the worker's lease
//! ```
//!
//! `prefix` is one or more `/`-separated segments of `[A-Za-z0-9._-]` (for example
//! `tandem` or `tandem/staging`), so several clusters can share one etcd. `role` is
//! `prefill` or `decode`; `id` is the worker id. Everything a coordinator needs to know
//! about membership lives under `/{prefix}/workers/`, which it lists and watches as one
//! range.

use crate::info::check_name;
use crate::{RegistryError, Role};

/// A validated cluster prefix, able to build and parse worker keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterPrefix {
    /// `/{prefix}/workers/`, with both slashes.
    workers: String,
}

impl ClusterPrefix {
    /// Parses `prefix`; leading and trailing slashes are ignored.
    pub fn new(prefix: &str) -> Result<Self, RegistryError> {
        let trimmed = prefix.trim_matches('/');
        if trimmed.is_empty() {
            return Err(RegistryError::invalid("prefix", "must not be empty"));
        }
        for segment in trimmed.split('/') {
            check_name("prefix", segment)?;
        }
        Ok(Self { workers: format!("/{trimmed}/workers/") })
    }

    /// `/{prefix}/workers/`: the range holding every worker.
    pub fn workers(&self) -> &str {
        &self.workers
    }

    /// `/{prefix}/workers/{role}/{id}`. `id` must already be valid.
    pub fn worker_key(&self, role: Role, id: &str) -> String {
        format!("{}{}/{}", self.workers, role.as_str(), id)
    }

    /// The role and id in a key under [`ClusterPrefix::workers`], or `None` for any other key.
    pub fn parse_key<'k>(&self, key: &'k str) -> Option<(Role, &'k str)> {
        let rest = key.strip_prefix(self.workers.as_str())?;
        let (role, id) = rest.split_once('/')?;
        let role = role.parse().ok()?;
        check_name("id", id).ok()?;
        Some((role, id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        let p = ClusterPrefix::new("/tandem/staging/").expect("valid prefix");
        assert_eq!(p.workers(), "/tandem/staging/workers/");
        let key = p.worker_key(Role::Decode, "d-0");
        assert_eq!(key, "/tandem/staging/workers/decode/d-0");
        assert_eq!(p.parse_key(&key), Some((Role::Decode, "d-0")));
        assert_eq!(p.parse_key("/tandem/staging/workers/router/x"), None);
        assert_eq!(p.parse_key("/tandem/staging/workers/decode/a/b"), None);
        assert_eq!(p.parse_key("/tandem/other/workers/decode/x"), None);
    }

    #[test]
    fn bad_prefixes() {
        for bad in ["", "/", "a//b", "a b", "..", "a/./b"] {
            assert!(ClusterPrefix::new(bad).is_err(), "{bad:?} accepted");
        }
    }
}
