//! A request's priority class, as the coordinator admits it and the
//! engine's waiting queue and preemption order by it.

use std::fmt;
use std::str::FromStr;

/// A request's class. Classes are served in strict order: a queued High
/// request always goes before any Normal one, Normal before Low. `Ord`
/// follows that order (`High < Normal < Low`: earlier is served first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum Priority {
    High,
    #[default]
    Normal,
    Low,
}

/// A priority that is not `high`, `normal` or `low`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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

    /// 0 for High, 1 for Normal, 2 for Low: the index into per-class arrays.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_order_high_first_and_parse_by_name_only() {
        assert!(Priority::High < Priority::Normal && Priority::Normal < Priority::Low);
        for p in Priority::ALL {
            assert_eq!(Priority::ALL[p.index()], p);
            assert_eq!(Priority::parse(&p.as_str().to_uppercase()), Ok(p));
        }
        assert!(Priority::parse("0").is_err());
        assert_eq!(Priority::default(), Priority::Normal);
    }
}
