//! The runner's typed error and the kind a caller (or the wire) acts on.

use crate::batch::EngineError;
use crate::kv::KvError;

/// What the caller can do about a [`RunnerError`]; this is what crosses the
/// wire (gRPC status, HTTP code) and what metrics are labelled by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ErrorKind {
    /// The request itself is bad; retrying it unchanged fails again (400/413).
    InvalidInput,
    /// The runner is full; retry later or elsewhere (503 + Retry-After).
    Overloaded,
    /// The request's deadline passed before it finished (504).
    Deadline,
    /// The request was aborted, or its client went away.
    Cancelled,
    /// The runner is draining or gone; retry on another worker.
    ShuttingDown,
    /// A bug or a failed forward pass; the request cannot be trusted.
    Internal,
}

/// Why a request was refused or did not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RunnerError {
    /// The engine rejected the request (prompt empty or too long, bad
    /// sampling parameters, duplicate id, wrong block count).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The queue beyond the running seats is full.
    #[error("overloaded: {waiting} requests waiting, the bound is {max_waiting}")]
    Overloaded { waiting: usize, max_waiting: usize },
    /// A reservation asked for more KV blocks than are free.
    #[error("KV cache full: {needed} blocks needed, {available} free")]
    NoKvBlocks { needed: usize, available: usize },
    /// The request's deadline passed; its work was stopped and its blocks freed.
    #[error("deadline exceeded")]
    Deadline,
    /// Aborted by the caller, or its sink panicked (client gone).
    #[error("cancelled")]
    Cancelled,
    /// Shutdown began before the request was admitted or before it finished.
    #[error("runner is shutting down")]
    ShuttingDown,
    /// The engine failed (e.g. a forward-pass error); the message says how.
    #[error("internal engine error: {0}")]
    Internal(String),
}

impl RunnerError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Invalid(_) => ErrorKind::InvalidInput,
            Self::Overloaded { .. } | Self::NoKvBlocks { .. } => ErrorKind::Overloaded,
            Self::Deadline => ErrorKind::Deadline,
            Self::Cancelled => ErrorKind::Cancelled,
            Self::ShuttingDown => ErrorKind::ShuttingDown,
            Self::Internal(_) => ErrorKind::Internal,
        }
    }

    /// Sorts an engine error into the caller's input versus our own failure.
    pub(crate) fn from_engine(e: EngineError) -> Self {
        match e {
            EngineError::InvalidPrompt(_) | EngineError::InvalidParams(_) | EngineError::DuplicateId(_) => {
                Self::Invalid(e.to_string())
            }
            // A reservation that does not fit is capacity, not a bug.
            EngineError::Kv(KvError::Exhausted { needed, available, .. }) => Self::NoKvBlocks { needed, available },
            EngineError::Config { .. } | EngineError::Kv(_) | EngineError::Forward(_) | EngineError::Internal(_) => {
                Self::Internal(e.to_string())
            }
        }
    }
}

/// Why [`RunnerHandle::post_pool`](super::RunnerHandle::post_pool) did not queue a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PostError {
    /// The command queue is full (overload: see the runner's module docs);
    /// the job was dropped unrun. Never waited for: the caller decides.
    #[error("the runner's command queue is full ({capacity} commands)")]
    Full { capacity: usize },
    /// The runner thread has exited.
    #[error("the engine thread has exited")]
    Exited,
}
