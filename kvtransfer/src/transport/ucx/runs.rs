//! Runs of blocks consecutive on both sides of a copy between pools: each
//! run is one contiguous piece of a layer's K (or V) in both, so it is
//! copied or checksummed in one call (the fused loops want long pieces).

/// `len` blocks from position `index` of the list: source blocks
/// `from..from + len`, destination blocks `to..to + len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Run {
    pub index: usize,
    pub from: usize,
    pub to: usize,
    pub len: usize,
}

/// The runs of `pairs` (source block, destination block), in order: a pair
/// extends the run before it when both of its blocks follow that run's.
pub(super) fn runs(pairs: impl IntoIterator<Item = (usize, usize)>) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for (index, (from, to)) in pairs.into_iter().enumerate() {
        match out.last_mut() {
            Some(r) if r.from + r.len == from && r.to + r.len == to => r.len += 1,
            _ => out.push(Run { index, from, to, len: 1 }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_breaks_where_either_side_stops_following() {
        let got = runs([(2, 7), (3, 8), (5, 9), (4, 10), (5, 11), (6, 13)]);
        let want = [
            Run { index: 0, from: 2, to: 7, len: 2 },
            Run { index: 2, from: 5, to: 9, len: 1 },
            Run { index: 3, from: 4, to: 10, len: 2 },
            Run { index: 5, from: 6, to: 13, len: 1 },
        ];
        assert_eq!(got, want);
        assert!(runs([]).is_empty());
    }
}
