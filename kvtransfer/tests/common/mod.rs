//! Helpers shared by the kvtransfer integration tests.

use engine::kv::{BlockId, KvLayout, KvPool};

/// Prefill side: a pool of `pool_blocks` whose `n` allocated blocks (ids
/// offset by two, so they differ from a fresh pool's) hold distinct known
/// K/V values.
pub fn source(l: KvLayout, n: usize, pool_blocks: usize) -> (KvPool, Vec<BlockId>) {
    let mut pool = KvPool::new(l, pool_blocks).expect("pool A");
    let _skip = pool.allocate(2).expect("offset the ids");
    let table = pool.allocate(n).expect("alloc A");
    let row = l.row_elems();
    for layer in 0..l.n_layers {
        for (i, &b) in table.iter().enumerate() {
            for slot in 0..l.block_size {
                let k: Vec<f32> = (0..row).map(|j| ((layer * 1000 + i * 100 + slot * 10 + j) as f32) * 0.25).collect();
                let v: Vec<f32> = k.iter().map(|x| -x - 0.5).collect();
                pool.write(layer, b, slot, &k, &v);
            }
        }
    }
    (pool, table)
}
