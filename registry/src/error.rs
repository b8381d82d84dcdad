//! The one error type of this crate.

use std::time::Duration;

/// What went wrong talking to the registry.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    /// A configuration value or a [`crate::WorkerInfo`] field is invalid; `field` names it.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// The field, as the caller spells it (`ttl`, `prefix`, `info.id`, ...).
        field: &'static str,
        /// Why it was refused.
        reason: String,
    },
    /// etcd answered with an error, or the connection to it failed.
    #[error("etcd {op}: {source}")]
    Etcd {
        /// The operation that failed (`lease grant`, `list`, ...).
        op: &'static str,
        /// The client's error.
        #[source]
        source: etcd_client::Error,
    },
    /// etcd did not answer within the bound.
    #[error("etcd {op} did not answer within {after:?}")]
    Timeout {
        /// The operation that timed out.
        op: &'static str,
        /// The bound that passed.
        after: Duration,
    },
    /// The worker's key is held by another live lease: another process registered the same
    /// worker id (or a crashed one's lease has not expired yet and the takeover wait passed).
    #[error("key {key} is held by lease {lease:x}: is another worker running with this id?")]
    KeyHeld {
        /// The etcd key.
        key: String,
        /// The lease that holds it (0 when it could not be read).
        lease: i64,
    },
    /// A [`crate::WorkerInfo`] could not be encoded as JSON.
    #[error("encoding worker info: {0}")]
    Encode(#[from] serde_json::Error),
    /// The registration's background task has ended (deregistered, abandoned or dropped).
    #[error("the registration has stopped")]
    Stopped,
}

impl RegistryError {
    /// Whether trying again later may succeed (etcd unreachable, slow, or a key held by a
    /// lease that may still expire). Invalid input and a stopped registration are final.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Etcd { .. } | Self::Timeout { .. } | Self::KeyHeld { .. })
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Invalid { field, reason: reason.into() }
    }
}
