//! What admission sees of a request ([`Ticket`], its [`Priority`] class)
//! and what it answers when it refuses one ([`Shed`]).

use std::time::Duration;

use thiserror::Error;
use tokio::time::Instant;

use types::priority::Priority;

/// What admission knows of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// The caller's identity for fairness and per-key limits: its API key,
    /// or [`ANONYMOUS`](super::ANONYMOUS).
    pub key: String,
    pub priority: Priority,
    /// Prompt tokens + `max_tokens`: the most work the request can cause.
    pub cost: u64,
    /// When the request stops being worth starting.
    pub deadline: Instant,
}

/// Why a ticket was not admitted. Nothing was started for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Shed {
    /// The caller's own key has as many tickets or tokens queued as it may:
    /// HTTP 429 with `Retry-After`. Other keys are still admitted.
    #[error("too many requests queued for this API key")]
    KeyLimit { retry_after: Duration },
    /// The whole queue is full, with nothing of a lower class to displace;
    /// or this ticket was queued and a higher-class one took its place:
    /// HTTP 503 with `Retry-After`.
    #[error("server overloaded: the admission queue is full")]
    QueueFull { retry_after: Duration },
    /// The deadline passed before a slot was free: HTTP 504. The request
    /// never reached a worker.
    #[error("the request deadline passed while it was queued")]
    Deadline,
    /// The coordinator is shutting down: HTTP 503 with the base
    /// `Retry-After` (another coordinator can take it).
    #[error("the coordinator is shutting down")]
    Closed,
}

impl Shed {
    /// How long the client should wait before trying again, when that is
    /// worth saying: whole seconds in [1, 60].
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Shed::KeyLimit { retry_after } | Shed::QueueFull { retry_after } => Some(*retry_after),
            Shed::Deadline | Shed::Closed => None,
        }
    }
}
