//! What a caller may do with a [`WorkerError`]: the one decision every hop
//! makes from an error kind, kept beside the enum so that all hops agree.

use types::sampling::SamplerError;

use crate::worker::v1::{ErrorKind, WorkerError};

impl ErrorKind {
    /// True when the same request, unchanged, may succeed if sent again (to
    /// this or another worker): a transient failure or a full worker.
    ///
    /// Everything else is final for that request: a spent deadline, a bad
    /// request, a version mismatch (a routing fault: another pair must be
    /// chosen, not the same call repeated), a KV load failure (the
    /// `kv_load_failure_policy` already had its retries), a cancellation, an
    /// internal error, and an unset kind (treated as internal).
    pub fn is_retryable(self) -> bool {
        match self {
            Self::Retryable | Self::Overloaded => true,
            Self::Unspecified
            | Self::Deadline
            | Self::VersionMismatch
            | Self::KvLoadFailed
            | Self::InvalidArgument
            | Self::Internal
            | Self::Cancelled => false,
        }
    }
}

impl WorkerError {
    /// A `WorkerError` of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self { kind: kind as i32, message: message.into() }
    }
}

impl From<&SamplerError> for WorkerError {
    /// Bad sampling parameters are the client's fault (`INVALID_ARGUMENT`);
    /// bad logits or history are the engine's (`INTERNAL`).
    fn from(err: &SamplerError) -> Self {
        let kind = if err.is_invalid_input() { ErrorKind::InvalidArgument } else { ErrorKind::Internal };
        Self::new(kind, err.to_string())
    }
}
