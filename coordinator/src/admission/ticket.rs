//! What admission sees of a request ([`Ticket`], its [`Priority`] class)
//! and what it answers when it refuses one ([`Shed`]).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use thiserror::Error;
use tokio::time::Instant;

/// A request's class. Classes are served in strict order: a queued High
/// ticket always goes before any Normal one, Normal before Low.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

/// A priority that is not `high`, `normal` or `low`.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("priority must be high, normal or low, not {0:?}")]
pub struct PriorityParseError(pub String);

impl Priority {
    /// All classes, highest first; `Priority::ALL[p.index()] == p`.
    pub const ALL: [Priority; 3] = [Priority::High, Priority::Normal, Priority::Low];

    /// `high`, `normal` or `low`, in any case. Numbers are refused: whether
    /// 0 is the highest or the lowest is a guess clients would get wrong.
    pub fn parse(s: &str) -> Result<Self, PriorityParseError> {
        Self::ALL
            .into_iter()
            .find(|p| s.eq_ignore_ascii_case(p.as_str()))
            .ok_or_else(|| PriorityParseError(s.chars().take(32).collect()))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Priority::High => "high",
            Priority::Normal => "normal",
            Priority::Low => "low",
        }
    }

    /// 0 for High, 1 for Normal, 2 for Low (the index into
    /// [`AdmissionStats::queued_by_priority`](super::AdmissionStats::queued_by_priority)).
    pub fn index(self) -> usize {
        self as usize
    }
}

impl FromStr for Priority {
    type Err = PriorityParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

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
