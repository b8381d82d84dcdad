//! Where a sequence goes in the waiting queue and in the running list, by
//! priority class.
//!
//! Both lists are kept sorted by class, highest first, and by arrival
//! inside a class:
//! - **waiting**: a new request goes behind every request of its class or
//!   a higher one (FIFO inside a class); a preempted one goes back in front
//!   of its own class only, so preemption never lets a lower class jump a
//!   higher one.
//! - **running**: an admitted sequence goes behind every running one of its
//!   class or higher. The back of the list is then the lowest class's most
//!   recently admitted sequence, which is whom preemption evicts first; and
//!   the scheduler, walking the list front to back, gives higher classes
//!   their decode and prefill tokens first. A sequence is only ever evicted
//!   for one at or above it in the list, so never for a lower class.
//!
//! Strict priority can starve: while higher classes keep every seat or
//! block busy, a Low request waits. That is the choice here, for three
//! reasons: it is the coordinator's admission order too (a worker that
//! reordered differently would undo it); the worker's queue is short and
//! bounded (`max_waiting`), so the coordinator, which sees all classes'
//! demand, is where lower classes are held back; and every request carries
//! a deadline, so a starved request ends with a typed `Deadline` error
//! rather than waiting without end. Operators see it coming in
//! `tandem_num_requests_waiting_by_priority{priority="low"}`.

use types::priority::Priority;

/// The index at which a `p` entry goes behind every entry of its class or a
/// higher one (the first entry of a strictly lower class).
pub(super) fn behind_class(classes: impl IntoIterator<Item = Priority>, p: Priority) -> usize {
    let mut n = 0;
    for q in classes {
        if q > p {
            return n;
        }
        n += 1;
    }
    n
}

/// The index at which a `p` entry goes in front of its own class (the first
/// entry of its class or a lower one).
pub(super) fn front_of_class(classes: impl IntoIterator<Item = Priority>, p: Priority) -> usize {
    let mut n = 0;
    for q in classes {
        if q >= p {
            return n;
        }
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use Priority::{High, Low, Normal};

    fn push_back(list: &mut Vec<(Priority, u32)>, p: Priority, id: u32) {
        let at = behind_class(list.iter().map(|e| e.0), p);
        list.insert(at, (p, id));
    }

    fn push_front(list: &mut Vec<(Priority, u32)>, p: Priority, id: u32) {
        let at = front_of_class(list.iter().map(|e| e.0), p);
        list.insert(at, (p, id));
    }

    fn ids(list: &[(Priority, u32)]) -> Vec<u32> {
        list.iter().map(|e| e.1).collect()
    }

    #[test]
    fn higher_classes_go_first_and_each_class_is_fifo() {
        let mut q = Vec::new();
        for (id, p) in [(1, Low), (2, Normal), (3, High), (4, Low), (5, High), (6, Normal)] {
            push_back(&mut q, p, id);
        }
        assert_eq!(ids(&q), [3, 5, 2, 6, 1, 4]);
    }

    #[test]
    fn a_preempted_request_goes_in_front_of_its_own_class_only() {
        let mut q = Vec::new();
        for (id, p) in [(1, High), (2, Normal), (3, Low)] {
            push_back(&mut q, p, id);
        }
        push_front(&mut q, Normal, 9);
        assert_eq!(ids(&q), [1, 9, 2, 3], "behind High, before the waiting Normal");
        push_front(&mut q, Low, 8);
        assert_eq!(ids(&q), [1, 9, 2, 8, 3]);
        push_front(&mut q, High, 7);
        assert_eq!(ids(&q), [7, 1, 9, 2, 8, 3]);
        let mut empty = Vec::new();
        push_front(&mut empty, Low, 1);
        push_back(&mut empty, High, 2);
        assert_eq!(ids(&empty), [2, 1]);
    }

    /// The running list's back is whom preemption evicts: the lowest
    /// class's newest, whatever the order of admission.
    #[test]
    fn the_back_of_running_is_the_lowest_class_newest() {
        let mut running = Vec::new();
        for (id, p) in [(1, Low), (2, High), (3, Low), (4, Normal), (5, High)] {
            push_back(&mut running, p, id);
        }
        let mut evicted = Vec::new();
        while let Some((_, id)) = running.pop() {
            evicted.push(id);
        }
        assert_eq!(evicted, [3, 1, 4, 5, 2]);
    }
}
