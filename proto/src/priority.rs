//! [`Priority`] on the wire <-> [`types::priority::Priority`].
//!
//! The wire enum has an UNSPECIFIED value (0, what an older sender leaves)
//! and prost reads an unknown number as it; both mean Normal, the class a
//! request without one has everywhere else.

use types::priority::Priority as Class;

use crate::worker::v1::Priority;

impl From<Class> for Priority {
    fn from(p: Class) -> Self {
        match p {
            Class::High => Priority::High,
            Class::Normal => Priority::Normal,
            Class::Low => Priority::Low,
        }
    }
}

impl From<Priority> for Class {
    fn from(p: Priority) -> Self {
        match p {
            Priority::High => Class::High,
            Priority::Normal | Priority::Unspecified => Class::Normal,
            Priority::Low => Class::Low,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::v1::GenerateRequest;

    #[test]
    fn every_class_round_trips_and_unset_or_unknown_is_normal() {
        for c in Class::ALL {
            assert_eq!(Class::from(Priority::from(c)), c);
        }
        let mut req = GenerateRequest::default();
        assert_eq!(Class::from(req.priority()), Class::Normal, "unset");
        req.priority = 99;
        assert_eq!(Class::from(req.priority()), Class::Normal, "a number this build does not know");
        req.set_priority(Priority::Low);
        assert_eq!(Class::from(req.priority()), Class::Low);
    }
}
