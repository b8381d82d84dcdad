//! Priority classes in the engine, on the real model: the waiting queue
//! admits higher classes first and FIFO inside a class, a preempted
//! sequence goes back in front of its own class only, and KV exhaustion
//! evicts the lowest class first whatever the admission order.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use std::collections::HashMap;

use common::{engine, greedy};
use engine::batch::{Engine, EngineConfig, Request};
use types::priority::Priority;

fn req(id: u64, prompt: &[u32], max_tokens: u32, priority: Priority) -> Request {
    Request { id, prompt: prompt.to_vec(), params: greedy(max_tokens), salt: 0, priority, generated: Vec::new() }
}

/// Steps until idle; returns ids in the order of their first token, and
/// each id's tokens.
fn drain(e: &mut Engine) -> (Vec<u64>, HashMap<u64, Vec<u32>>) {
    let (mut first, mut out) = (Vec::new(), HashMap::<u64, Vec<u32>>::new());
    let mut steps = 0;
    while e.has_work() {
        for ev in e.step().expect("step") {
            let toks = out.entry(ev.id).or_default();
            if toks.is_empty() {
                first.push(ev.id);
            }
            toks.push(ev.token.id);
        }
        steps += 1;
        assert!(steps < 10_000, "engine did not finish");
    }
    (first, out)
}

#[test]
fn one_seat_serves_higher_classes_first_and_fifo_inside_a_class() {
    use Priority::{High, Low, Normal};
    let (mut e, tok) = engine(EngineConfig { max_running: 1, ..EngineConfig::default() });
    let p = tok.encode("The capital of France is", false).expect("encode");
    for (id, class) in [(1, Low), (2, Normal), (3, High), (4, Low), (5, High), (6, Normal)] {
        e.add(req(id, &p, 2, class)).expect("add");
    }
    assert_eq!(e.waiting_by_class(), [2, 2, 2]);
    assert_eq!(e.waiting_order().collect::<Vec<_>>(), [3, 5, 2, 6, 1, 4]);
    let (first, out) = drain(&mut e);
    assert_eq!(first, [3, 5, 2, 6, 1, 4], "first tokens in class order, FIFO inside a class");
    assert!(out.values().all(|t| t.len() == 2));
    // A High that arrives later still goes ahead of a Normal already
    // waiting; the Low already seated keeps its seat (no eviction for a
    // seat, only for KV).
    e.add(req(7, &p, 2, Low)).expect("add");
    e.step().expect("step"); // seats 7: it was alone in the queue
    e.add(req(8, &p, 2, Normal)).expect("add");
    e.add(req(9, &p, 2, High)).expect("add");
    assert_eq!(e.waiting_order().collect::<Vec<_>>(), [9, 8]);
    let (first, _) = drain(&mut e);
    assert_eq!(first, [7, 9, 8], "7's second token, then 9, then 8");
    assert_eq!(e.kv_stats().used, 0);
}

/// Low is admitted first, High after it: "most recently admitted" would
/// evict High. The lowest class goes instead, High never loses a token of
/// progress, and both end with the tokens each gets alone.
#[test]
fn kv_exhaustion_preempts_the_lowest_class_even_when_admitted_first() {
    // Blocks of 4 tokens; each sequence grows to (prompt + 24) / 4 blocks,
    // about 8; 11 blocks hold one such sequence, not two.
    let cfg = EngineConfig { block_size: 4, kv_blocks: 11, prefix_cache: false, ..EngineConfig::default() };
    let (mut alone, tok) = engine(cfg.clone());
    let low_p = tok.encode("Once upon a time", false).expect("encode");
    let high_p = tok.encode("List three colors:", false).expect("encode");
    assert!(low_p.len() <= 8 && high_p.len() <= 8, "prompts of at most two blocks");
    let mut reference = HashMap::new();
    for (id, p) in [(1, &low_p), (2, &high_p)] {
        alone.add(req(id, p, 24, Priority::Normal)).expect("add");
        reference.extend(drain(&mut alone).1);
    }
    drop(alone);

    let (mut e, _) = engine(cfg);
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut step = |e: &mut Engine| {
        for ev in e.step().expect("step") {
            out.entry(ev.id).or_default().push(ev.token.id);
        }
    };
    e.add(req(1, &low_p, 24, Priority::Low)).expect("add");
    step(&mut e); // Low admitted first
    e.add(req(2, &high_p, 24, Priority::High)).expect("add");
    step(&mut e);
    assert_eq!(e.running_order().collect::<Vec<_>>(), [2, 1], "High ahead of Low in the running list");
    let mut high_progress = 0;
    let mut steps = 0;
    while e.has_work() {
        step(&mut e);
        let now = e.computed_tokens(2).unwrap_or(usize::MAX);
        assert!(now >= high_progress, "High lost KV ({high_progress} -> {now} tokens): it was preempted");
        high_progress = now;
        steps += 1;
        assert!(steps < 10_000, "engine did not finish");
    }
    let [high, normal, low] = e.preemptions_by_class();
    assert!(low > 0, "the pool should have forced a preemption");
    assert_eq!((high, normal), (0, 0), "only the low class may be preempted");
    assert_eq!(e.preemptions(), low);
    assert_eq!(out, reference, "each sequence's tokens equal its run alone");
    assert_eq!(e.kv_stats().used, 0);
}
