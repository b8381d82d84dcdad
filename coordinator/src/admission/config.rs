//! The queue's limits.

use thiserror::Error;

/// Limits of the admission queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionConfig {
    /// Requests running at once (holding a [`Seat`](super::Seat)). The default, 8, is a
    /// cautious start; the cluster raises it with
    /// [`Admission::set_max_running`](super::Admission::set_max_running) once it knows its workers' capacity.
    pub max_running: usize,
    /// Tickets queued at once, all keys. The default, 64 (8 per running
    /// slot), is about what can be served within a typical deadline; a
    /// deeper queue mostly produces timeouts instead of quick 503s.
    pub max_queued: usize,
    /// Tokens (prompt + `max_tokens`) queued at once, all keys. Default:
    /// 64 requests of a 2,048-token budget.
    pub max_queued_tokens: u64,
    /// Tickets queued at once for one key. Default 16: one key can fill at
    /// most a quarter of the default queue, so at least four keys always
    /// find room.
    pub per_key_max_queued: usize,
    /// Tokens queued at once for one key. Default: 16 requests of a
    /// 2,048-token budget, a quarter of the default token bound.
    pub per_key_max_queued_tokens: u64,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            max_running: 8,
            max_queued: 64,
            max_queued_tokens: 64 * 2048,
            per_key_max_queued: 16,
            per_key_max_queued_tokens: 16 * 2048,
        }
    }
}

/// A configuration that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// A limit is zero, so nothing could ever run or queue.
    #[error("admission.{field} must be at least 1")]
    Zero { field: &'static str },
}

impl AdmissionConfig {
    /// Refuses a zero limit, naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let zero = [
            ("max_running", self.max_running == 0),
            ("max_queued", self.max_queued == 0),
            ("max_queued_tokens", self.max_queued_tokens == 0),
            ("per_key_max_queued", self.per_key_max_queued == 0),
            ("per_key_max_queued_tokens", self.per_key_max_queued_tokens == 0),
        ];
        match zero.into_iter().find(|(_, is_zero)| *is_zero) {
            Some((field, _)) => Err(ConfigError::Zero { field }),
            None => Ok(()),
        }
    }
}
