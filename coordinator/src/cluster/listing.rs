//! The workers a routing decision lists, kept as one table between decisions
//! ([`Listing`]).
//!
//! A decision over 1,000 workers cost 0.25-0.5 ms of CPU in a live coordinator
//! (`tandem bench scale`) against 49 µs in `benches/route.rs`: profiled, the difference
//! was memory, not arithmetic. Listing each worker from the membership map touched its
//! registration's strings one heap block each (group, layout, zone, address), cold
//! between two decisions while thousands of polls ran; the candidate lists grew by
//! reallocation; each candidate's prefix bonus hashed its address. The table is built
//! once per membership revision and load-board epoch: group, layout, determinism and
//! zone strings interned (the router compares them by pointer first), each worker's
//! board slot resolved, and an index by address for the prompt's few prefix holders. A
//! decision then walks it in order and reads only the numbers that change.

use std::sync::Arc;

use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use tokio::time::Instant;

use types::rng::XorShift64;

/// Fleets of up to this many decode workers are listed whole for every decision.
pub(super) const LIST_ALL_UP_TO: usize = 64;
/// Members a sample draws: decode workers, and prefill workers of each version group
/// the drawn decode workers are in.
pub(super) const SAMPLE: usize = 16;

/// The key a table stays valid under: the membership's revision (0 for fixed
/// addresses) and the load board's epoch (slots unchanged).
pub(super) type Key = (i64, u64);

/// One worker as a decision reads it.
pub(super) struct Member {
    pub id: Arc<str>,
    pub addr: Arc<str>,
    pub version_group: Arc<str>,
    pub layout: Arc<str>,
    pub determinism: Arc<str>,
    pub zone: Arc<str>,
    pub decode: bool,
    pub max_running: u32,
    /// Its slot on the load board under the key's epoch.
    pub slot: Option<u32>,
    /// A departed worker (its key went away while it was not draining): routable
    /// until its grace ends.
    pub until: Option<Instant>,
}

impl Member {
    /// Whether a decision at `now` may list it.
    pub fn present(&self, now: Instant) -> bool {
        self.until.is_none_or(|t| now < t)
    }
}

/// The table for one key.
#[derive(Default)]
pub(super) struct Table {
    pub members: Vec<Member>,
    /// Members by address (a worker listed as both decode and prefill has two).
    pub by_addr: FxHashMap<Arc<str>, SmallVec<[u32; 2]>>,
    /// The decode members' places, and the prefill members' by version group.
    decode_members: Vec<u32>,
    prefill_by_group: FxHashMap<Arc<str>, Vec<u32>>,
}

/// What one worker is, as the table's builder is told.
pub(super) struct Entry<'a> {
    pub id: &'a str,
    pub addr: &'a str,
    pub version_group: &'a str,
    pub layout: &'a str,
    pub determinism: &'a str,
    pub zone: &'a str,
    pub decode: bool,
    pub max_running: u32,
    pub until: Option<Instant>,
}

impl Table {
    /// Builds the table of `entries`, in their order; `slot` finds an address on the
    /// load board.
    pub fn build<'a>(entries: impl Iterator<Item = Entry<'a>>, slot: impl Fn(&str) -> Option<u32>) -> Self {
        let mut strings: FxHashMap<&'a str, Arc<str>> = FxHashMap::default();
        let mut intern = |s: &'a str| strings.entry(s).or_insert_with(|| Arc::from(s)).clone();
        let mut t = Table::default();
        for e in entries {
            let addr: Arc<str> = Arc::from(e.addr);
            let i = u32::try_from(t.members.len()).unwrap_or(u32::MAX);
            t.by_addr.entry(addr.clone()).or_default().push(i);
            let version_group = intern(e.version_group);
            if e.decode {
                t.decode_members.push(i);
            } else {
                t.prefill_by_group.entry(version_group.clone()).or_default().push(i);
            }
            t.members.push(Member {
                id: if e.id == e.addr { addr.clone() } else { Arc::from(e.id) },
                slot: slot(e.addr),
                addr,
                version_group,
                layout: intern(e.layout),
                determinism: intern(e.determinism),
                zone: intern(e.zone),
                decode: e.decode,
                max_running: e.max_running,
                until: e.until,
            });
        }
        t
    }

    /// How many decode members it lists.
    pub fn decode(&self) -> usize {
        self.decode_members.len()
    }

    /// How many prefill members it lists.
    pub fn prefill(&self) -> usize {
        self.members.len() - self.decode_members.len()
    }

    /// The members one decision of a large fleet lists, in table order: the prompt's
    /// `holders`, [`SAMPLE`] decode members drawn at random, and [`SAMPLE`] prefill
    /// members of each version group those decode members are in (all of a smaller
    /// group). `None`: list everyone (at most [`LIST_ALL_UP_TO`] decode members).
    ///
    /// The best of a random sample is how large fleets are balanced (the power of d
    /// choices: the expected worst queue grows as log log n / log d instead of log n / log
    /// log n), and holding the prompt always earns a place. Listing every member cost a
    /// live coordinator 0.1-0.25 ms a decision at 1,000 workers, reading memory that
    /// thousands of polls had pushed out of the caches since the decision before.
    pub fn sample(&self, holders: &[(u32, f64)], rng: &mut XorShift64) -> Option<Vec<u32>> {
        if self.decode_members.len() <= LIST_ALL_UP_TO {
            return None;
        }
        let mut pick = Vec::with_capacity(holders.len() + 3 * SAMPLE);
        pick.extend(holders.iter().map(|&(i, _)| i));
        for _ in 0..SAMPLE {
            pick.push(self.decode_members[rng.index(self.decode_members.len())]);
        }
        let mut groups: SmallVec<[&Arc<str>; 2]> = SmallVec::new();
        for m in pick.iter().filter_map(|&i| self.members.get(i as usize)).filter(|m| m.decode) {
            if !groups.iter().any(|g| Arc::ptr_eq(g, &m.version_group)) {
                groups.push(&m.version_group);
            }
        }
        for g in groups {
            match self.prefill_by_group.get(g) {
                Some(ps) if ps.len() <= SAMPLE => pick.extend_from_slice(ps),
                Some(ps) => pick.extend((0..SAMPLE).map(|_| ps[rng.index(ps.len())])),
                None => {}
            }
        }
        pick.sort_unstable();
        pick.dedup();
        Some(pick)
    }
}

/// The last table built and its key.
#[derive(Default)]
pub(super) struct Listing {
    key: Option<Key>,
    table: Arc<Table>,
}

impl Listing {
    /// The table for `key`, built by `build` when the key changed.
    pub fn table(&mut self, key: Key, build: impl FnOnce() -> Table) -> Arc<Table> {
        if self.key != Some(key) {
            self.table = Arc::new(build());
            self.key = Some(key);
        }
        self.table.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry<'a>(addr: &'a str, group: &'a str, decode: bool) -> Entry<'a> {
        Entry {
            id: addr,
            addr,
            version_group: group,
            layout: "ab",
            determinism: "",
            zone: "",
            decode,
            max_running: 8,
            until: None,
        }
    }

    #[test]
    fn a_table_interns_shared_strings_and_indexes_every_address() {
        let groups = [String::from("g1"), String::from("g1"), String::from("g2")];
        let entries =
            vec![entry("d0", &groups[0], true), entry("p0", &groups[1], false), entry("d0", &groups[2], false)];
        let t = Table::build(entries.into_iter(), |a| (a == "p0").then_some(7));
        assert_eq!((t.decode(), t.prefill(), t.members.len()), (1, 2, 3));
        // Equal strings from different registrations are one allocation: compared by pointer.
        assert!(Arc::ptr_eq(&t.members[0].version_group, &t.members[1].version_group));
        assert!(!Arc::ptr_eq(&t.members[0].version_group, &t.members[2].version_group));
        assert!(Arc::ptr_eq(&t.members[0].layout, &t.members[2].layout));
        assert_eq!(t.members.iter().map(|m| m.slot).collect::<Vec<_>>(), [None, Some(7), None]);
        assert_eq!(t.by_addr["d0"].as_slice(), [0, 2]);
        assert_eq!(t.by_addr["p0"].as_slice(), [1]);
    }

    #[test]
    fn a_sample_takes_the_holders_and_the_drawn_decode_workers_groups() {
        let names: Vec<String> = (0..200).map(|i| format!("w{i}")).collect();
        // 100 decode workers of group a; 60 prefill workers of group a, 40 of group b.
        let entries = names.iter().enumerate().map(|(i, n)| entry(n, if i < 160 { "a" } else { "b" }, i < 100));
        let t = Table::build(entries, |_| None);
        let mut rng = XorShift64::new(42);
        let holders = [(7, 1.0), (150, 0.5), (180, 0.5)];
        for _ in 0..20 {
            let pick = t.sample(&holders, &mut rng).expect("a large fleet is sampled");
            assert!(pick.windows(2).all(|w| w[0] < w[1]), "in table order, once each");
            assert!(holders.iter().all(|(h, _)| pick.contains(h)), "every holder listed");
            let decode = pick.iter().filter(|&&i| i < 100).count();
            assert!((1..=SAMPLE + 1).contains(&decode), "{decode} decode workers");
            let group_a = pick.iter().filter(|&&i| (100..160).contains(&i)).count();
            assert!((1..=SAMPLE + 1).contains(&group_a), "{group_a} prefill workers of group a");
            // No decode worker is in group b: only its holder is listed from it.
            assert_eq!(pick.iter().filter(|&&i| i >= 160).copied().collect::<Vec<_>>(), [180]);
        }
        let small = Table::build(names[..LIST_ALL_UP_TO].iter().map(|n| entry(n, "a", true)), |_| None);
        assert!(small.sample(&[], &mut rng).is_none(), "a small fleet is listed whole");
    }

    #[test]
    fn a_listing_rebuilds_only_when_its_key_changes() {
        let mut l = Listing::default();
        let mut builds = 0;
        let mut build = || {
            builds += 1;
            Table::default()
        };
        let a = l.table((1, 0), &mut build);
        let b = l.table((1, 0), &mut build);
        assert!(Arc::ptr_eq(&a, &b));
        let c = l.table((1, 1), &mut build);
        assert!(!Arc::ptr_eq(&a, &c));
        l.table((2, 1), &mut build);
        assert_eq!(builds, 3);
    }

    #[test]
    fn a_departed_member_is_listed_until_its_grace_ends() {
        let now = Instant::now();
        let mut e = entry("d0", "g", true);
        e.until = Some(now + std::time::Duration::from_secs(1));
        let t = Table::build(std::iter::once(e), |_| None);
        assert!(t.members[0].present(now));
        assert!(!t.members[0].present(now + std::time::Duration::from_secs(1)));
    }
}
