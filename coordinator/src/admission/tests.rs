use super::*;
use futures_util::FutureExt;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use types::priority::{Priority, PriorityParseError};

type Admit<'a> = Pin<Box<dyn Future<Output = Result<Seat, Shed>> + 'a>>;

fn admission(cfg: AdmissionConfig) -> Arc<Admission> {
    Admission::new(cfg).expect("valid config")
}

fn running(max_running: usize) -> AdmissionConfig {
    AdmissionConfig { max_running, ..AdmissionConfig::default() }
}

fn ticket(key: &str, priority: Priority, cost: u64) -> Ticket {
    Ticket { key: key.into(), priority, cost, deadline: Instant::now() + Duration::from_secs(60) }
}

fn admit(a: &Arc<Admission>, t: Ticket) -> Admit<'_> {
    Box::pin(a.admit(t))
}

/// Polls once; `None` while the ticket waits. Unconstrained: these
/// tests poll many futures from one task, and tokio's cooperative
/// budget would otherwise report a delivered verdict as pending.
fn poll(f: &mut Admit<'_>) -> Option<Result<Seat, Shed>> {
    tokio::task::unconstrained(f.as_mut()).now_or_never()
}

/// The refusal when `t` is refused at once.
fn shed(a: &Arc<Admission>, t: Ticket) -> Option<Shed> {
    poll(&mut admit(a, t)).and_then(|r| r.err())
}

fn granted(a: &Arc<Admission>, t: Ticket) -> Seat {
    match poll(&mut admit(a, t)) {
        Some(Ok(slot)) => slot,
        other => panic!("expected a slot at once, got {other:?}"),
    }
}

fn queued(a: &Arc<Admission>, t: Ticket) -> Admit<'_> {
    let mut f = admit(a, t);
    if let Some(r) = poll(&mut f) {
        panic!("expected the ticket to queue, got {r:?}");
    }
    f
}

/// Polls every waiter once; returns the names of those that got a
/// slot (kept in `slots`), in the order given.
fn settle(waiting: &mut Vec<(&'static str, Admit<'_>)>, slots: &mut Vec<Seat>) -> Vec<&'static str> {
    let mut got = Vec::new();
    waiting.retain_mut(|(name, f)| match poll(f) {
        None => true,
        Some(Ok(slot)) => {
            slots.push(slot);
            got.push(*name);
            false
        }
        Some(Err(e)) => panic!("{name}: unexpected {e:?}"),
    });
    got
}

/// The counters agree with the live entries, empty keys are gone, and
/// no slot is free while tickets wait.
fn check(a: &Admission) {
    let st = a.lock();
    let mut tokens = 0;
    let mut by_priority = [0; 3];
    let mut keys: HashMap<&str, (usize, u64)> = HashMap::new();
    for (place, e) in &st.queue {
        tokens += e.cost;
        by_priority[place.priority.index()] += 1;
        let k = keys.entry(e.key.as_str()).or_default();
        k.0 += 1;
        k.1 += e.cost;
    }
    assert_eq!(tokens, st.queued_tokens, "queued tokens");
    assert_eq!(by_priority, st.queued_by_priority, "queued by priority");
    assert_eq!(keys.len(), st.keys.len(), "keys with nothing queued are dropped");
    for (k, (n, t)) in keys {
        let used = st.keys.get(k).map(|u| (u.queued, u.tokens));
        assert_eq!(used, Some((n, t)), "key {k}");
    }
    assert!(st.queue.is_empty() || st.running >= st.cfg.max_running, "a slot is free while tickets wait");
}

#[test]
fn config_defaults_are_valid_and_zero_limits_name_their_field() {
    assert_eq!(AdmissionConfig::default().validate(), Ok(()));
    let d = AdmissionConfig::default;
    for (field, cfg) in [
        ("max_running", AdmissionConfig { max_running: 0, ..d() }),
        ("max_queued", AdmissionConfig { max_queued: 0, ..d() }),
        ("max_queued_tokens", AdmissionConfig { max_queued_tokens: 0, ..d() }),
        ("per_key_max_queued", AdmissionConfig { per_key_max_queued: 0, ..d() }),
        ("per_key_max_queued_tokens", AdmissionConfig { per_key_max_queued_tokens: 0, ..d() }),
    ] {
        assert_eq!(cfg.validate(), Err(ConfigError::Zero { field }));
        assert_eq!(Admission::new(cfg).err(), Some(ConfigError::Zero { field }));
    }
}

#[test]
fn priority_parses_names_in_any_case_and_nothing_else() {
    assert_eq!(Priority::parse("high"), Ok(Priority::High));
    assert_eq!(Priority::parse("NORMAL"), Ok(Priority::Normal));
    assert_eq!("Low".parse::<Priority>(), Ok(Priority::Low));
    for bad in ["0", "2", "urgent", "", " high"] {
        assert_eq!(Priority::parse(bad), Err(PriorityParseError(bad.into())));
    }
    assert_eq!(Priority::default(), Priority::Normal);
    assert!(Priority::High < Priority::Normal && Priority::Normal < Priority::Low);
    for (i, p) in Priority::ALL.into_iter().enumerate() {
        assert_eq!(p.index(), i);
    }
}

#[tokio::test(start_paused = true)]
async fn grants_at_once_under_capacity_and_queues_when_full() {
    let a = admission(running(2));
    let s1 = granted(&a, ticket("a", Priority::Normal, 10));
    let s2 = granted(&a, ticket("b", Priority::Low, 10));
    assert_eq!((s1.queue_wait(), s2.cost()), (Duration::ZERO, 10));
    let f = queued(&a, ticket("c", Priority::High, 10));
    let s = a.stats();
    assert_eq!((s.running, s.queued, s.queued_tokens, s.queued_by_priority), (2, 1, 10, [1, 0, 0]));
    // The future must be Send to run in the frontends' tasks.
    fn assert_send<T: Send>(_: &T) {}
    assert_send(&a.admit(ticket("d", Priority::Normal, 1)));
    drop((f, s1, s2));
    assert_eq!(a.stats(), AdmissionStats { max_running: 2, ..AdmissionStats::default() });
    check(&a);
}

#[tokio::test(start_paused = true)]
async fn dispatches_in_arrival_order_on_slot_drop() {
    let a = admission(running(1));
    let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 10))];
    let mut waiting: Vec<_> = ["x", "y", "z"].map(|k| (k, queued(&a, ticket(k, Priority::Normal, 100)))).into();
    let mut order = Vec::new();
    while !slots.is_empty() {
        slots.remove(0);
        order.extend(settle(&mut waiting, &mut slots));
        check(&a);
    }
    assert_eq!(order, ["x", "y", "z"]);
    let holder = granted(&a, ticket("h", Priority::Normal, 1));
    let mut w = vec![("w", queued(&a, ticket("w", Priority::Normal, 1)))];
    tokio::time::advance(Duration::from_millis(7)).await;
    drop(holder);
    assert_eq!(settle(&mut w, &mut slots), ["w"]);
    assert_eq!(slots.iter().map(Seat::queue_wait).collect::<Vec<_>>(), [Duration::from_millis(7)]);
}

#[tokio::test(start_paused = true)]
async fn higher_classes_go_first() {
    let a = admission(running(1));
    let mut slots = vec![granted(&a, ticket("h", Priority::Low, 1))];
    let mut waiting = vec![
        ("low", queued(&a, ticket("a", Priority::Low, 1))),
        ("normal", queued(&a, ticket("a", Priority::Normal, 1000))),
        ("high", queued(&a, ticket("b", Priority::High, 5000))),
    ];
    assert_eq!(a.stats().queued_by_priority, [1, 1, 1]);
    let mut order = Vec::new();
    while !slots.is_empty() {
        slots.remove(0);
        order.extend(settle(&mut waiting, &mut slots));
    }
    assert_eq!(order, ["high", "normal", "low"]);
}

#[tokio::test(start_paused = true)]
async fn small_requests_are_not_starved_by_a_key_with_large_ones() {
    let a = admission(running(1));
    let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 1))];
    let mut waiting = Vec::new();
    for _ in 0..10 {
        waiting.push(("A", queued(&a, ticket("A", Priority::Normal, 1000))));
    }
    for _ in 0..10 {
        waiting.push(("B", queued(&a, ticket("B", Priority::Normal, 100))));
    }
    let mut order = Vec::new();
    while !slots.is_empty() {
        slots.remove(0);
        order.extend(settle(&mut waiting, &mut slots));
    }
    assert_eq!(order.len(), 20, "everyone is served");
    let b_early = order[..8].iter().filter(|k| **k == "B").count();
    assert_eq!(b_early, 8, "B's small tickets go first, order {order:?}");
    check(&a);
}

/// Serves `waiting` one slot at a time from `slots`; the order served.
fn serve(n: usize, waiting: &mut Vec<(&'static str, Admit<'_>)>, slots: &mut Vec<Seat>) -> Vec<&'static str> {
    let mut order = Vec::new();
    while order.len() < n && !slots.is_empty() {
        slots.remove(0);
        order.extend(settle(waiting, slots));
    }
    order
}

#[tokio::test(start_paused = true)]
async fn a_large_request_is_not_starved_by_many_small_ones() {
    // Fairness is by cost, not shortest-first: B's small tickets arrived
    // first, yet A's one larger ticket goes once B has had about as much.
    let a = admission(running(1));
    let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 1))];
    let mut waiting = Vec::new();
    for _ in 0..10 {
        waiting.push(("B", queued(&a, ticket("B", Priority::Normal, 100))));
    }
    waiting.push(("A", queued(&a, ticket("A", Priority::Normal, 300))));
    let order = serve(11, &mut waiting, &mut slots);
    assert_eq!(order[..4], ["B", "B", "B", "A"], "order {order:?}");
}

#[tokio::test(start_paused = true)]
async fn a_late_key_gets_its_share_not_a_head_start() {
    // B starts at the class's virtual time, so it shares with A from
    // where A is, instead of being owed everything A got before.
    let a = admission(running(1));
    let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 1))];
    let mut waiting = Vec::new();
    for _ in 0..10 {
        waiting.push(("A", queued(&a, ticket("A", Priority::Normal, 100))));
    }
    assert_eq!(serve(5, &mut waiting, &mut slots), ["A"; 5]);
    for _ in 0..5 {
        waiting.push(("B", queued(&a, ticket("B", Priority::Normal, 100))));
    }
    assert_eq!(serve(4, &mut waiting, &mut slots), ["A", "B", "A", "B"]);
}

#[tokio::test(start_paused = true)]
async fn a_withdrawn_ticket_gives_back_its_place_in_line() {
    let a = admission(running(1));
    let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 1))];
    let mut waiting = vec![("x", queued(&a, ticket("A", Priority::Normal, 100)))];
    let gone = queued(&a, ticket("A", Priority::Normal, 1000));
    waiting.push(("b", queued(&a, ticket("B", Priority::Normal, 500))));
    drop(gone);
    // Without the withdrawn 1,000 tokens ahead of it, z finishes at 200.
    waiting.push(("z", queued(&a, ticket("A", Priority::Normal, 100))));
    assert_eq!(serve(3, &mut waiting, &mut slots), ["x", "z", "b"]);
}

#[tokio::test(start_paused = true)]
async fn a_key_over_its_share_is_refused_while_others_get_in() {
    let cfg = AdmissionConfig { per_key_max_queued: 2, per_key_max_queued_tokens: 1000, ..running(1) };
    let a = admission(cfg);
    let _holder = granted(&a, ticket("h", Priority::Normal, 1));
    let _a1 = queued(&a, ticket("a", Priority::Normal, 100));
    let _a2 = queued(&a, ticket("a", Priority::Low, 100));
    let refused = shed(&a, ticket("a", Priority::High, 1));
    assert_eq!(refused, Some(Shed::KeyLimit { retry_after: RETRY_AFTER_BASE }), "by count");
    let _b1 = queued(&a, ticket("b", Priority::Normal, 900));
    let refused = shed(&a, ticket("b", Priority::Normal, 200));
    assert!(matches!(refused, Some(Shed::KeyLimit { .. })), "by tokens: {refused:?}");
    let _c1 = queued(&a, ticket("c", Priority::Normal, 1000));
    assert_eq!(a.stats().queued, 4);
    check(&a);
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_refuses_its_own_class_and_above() {
    let cfg = AdmissionConfig { max_queued: 3, max_queued_tokens: 1000, ..running(1) };
    let a = admission(cfg);
    let _holder = granted(&a, ticket("h", Priority::Normal, 1));
    let _w = [queued(&a, ticket("a", Priority::Normal, 600)), queued(&a, ticket("b", Priority::Normal, 300))];
    let refused = shed(&a, ticket("c", Priority::Normal, 200));
    assert_eq!(refused, Some(Shed::QueueFull { retry_after: RETRY_AFTER_BASE }), "by tokens");
    let _c = queued(&a, ticket("c", Priority::Normal, 100));
    let refused = shed(&a, ticket("d", Priority::Low, 1));
    assert!(matches!(refused, Some(Shed::QueueFull { .. })), "by count: {refused:?}");
    check(&a);
}

#[tokio::test(start_paused = true)]
async fn a_full_queue_sheds_lower_classes_to_make_room() {
    let cfg = AdmissionConfig { max_queued: 3, max_queued_tokens: 1000, ..running(1) };
    let a = admission(cfg);
    let _holder = granted(&a, ticket("h", Priority::Normal, 1));
    let mut low1 = queued(&a, ticket("a", Priority::Low, 100));
    let mut low2 = queued(&a, ticket("b", Priority::Low, 100));
    let _normal = queued(&a, ticket("c", Priority::Normal, 700));
    let _high = queued(&a, ticket("d", Priority::High, 150));
    let displaced = poll(&mut low2).and_then(|r| r.err());
    assert_eq!(displaced, Some(Shed::QueueFull { retry_after: RETRY_AFTER_BASE }), "last-placed Low");
    assert!(poll(&mut low1).is_none(), "one was enough");
    // Shedding low1 would not make room for 300 tokens: nothing is shed.
    assert!(matches!(shed(&a, ticket("e", Priority::Normal, 300)), Some(Shed::QueueFull { .. })));
    assert!(poll(&mut low1).is_none(), "shed for nothing");
    let _n2 = queued(&a, ticket("e", Priority::Normal, 100));
    assert!(matches!(poll(&mut low1).and_then(|r| r.err()), Some(Shed::QueueFull { .. })));
    assert_eq!(a.stats().queued_by_priority, [1, 2, 0]);
    check(&a);
}

#[tokio::test(start_paused = true)]
async fn a_ticket_larger_than_a_bound_queues_alone() {
    let cfg = AdmissionConfig { max_queued_tokens: 1000, per_key_max_queued_tokens: 500, ..running(1) };
    let a = admission(cfg);
    let holder = granted(&a, ticket("h", Priority::Normal, 1));
    let mut big = queued(&a, ticket("a", Priority::Normal, 5000));
    let refused = shed(&a, ticket("a", Priority::Normal, 1));
    assert!(matches!(refused, Some(Shed::KeyLimit { .. })), "{refused:?}");
    let refused = shed(&a, ticket("b", Priority::Normal, 1));
    assert!(matches!(refused, Some(Shed::QueueFull { .. })), "{refused:?}");
    drop(holder);
    let running = poll(&mut big);
    assert!(matches!(running, Some(Ok(_))), "the large ticket runs: {running:?}");
    let _next = queued(&a, ticket("b", Priority::Normal, 3000));
}

#[tokio::test(start_paused = true)]
async fn deadline_in_queue_sheds_and_restores_accounting() {
    let a = admission(running(1));
    let holder = granted(&a, ticket("h", Priority::Normal, 1));
    let t = Ticket { deadline: Instant::now() + Duration::from_millis(100), ..ticket("a", Priority::Normal, 700) };
    let mut f = queued(&a, t);
    assert_eq!((a.stats().queued, a.stats().queued_tokens), (1, 700));
    tokio::time::advance(Duration::from_millis(99)).await;
    assert!(poll(&mut f).is_none(), "not yet");
    tokio::time::advance(Duration::from_millis(1)).await;
    assert_eq!(poll(&mut f).map(|r| r.err()), Some(Some(Shed::Deadline)));
    assert_eq!(a.stats(), AdmissionStats { running: 1, max_running: 1, ..AdmissionStats::default() });
    check(&a);
    drop(holder);
    let late = Ticket { deadline: Instant::now(), ..ticket("b", Priority::Normal, 1) };
    let refused = shed(&a, late);
    assert_eq!(refused, Some(Shed::Deadline), "a passed deadline is refused even with a free slot");
}

#[tokio::test(start_paused = true)]
async fn an_expired_ticket_is_skipped_at_dispatch() {
    let a = admission(running(1));
    let holder = granted(&a, ticket("h", Priority::Normal, 1));
    let t = Ticket { deadline: Instant::now() + Duration::from_millis(50), ..ticket("a", Priority::High, 1) };
    let mut expired = queued(&a, t);
    let mut next = queued(&a, ticket("b", Priority::Normal, 1));
    tokio::time::advance(Duration::from_millis(50)).await;
    // The expired ticket's waiter has not run yet; the free slot must
    // go past it.
    drop(holder);
    assert!(matches!(poll(&mut next), Some(Ok(_))));
    assert_eq!(poll(&mut expired).map(|r| r.err()), Some(Some(Shed::Deadline)));
    assert_eq!(a.stats().queued, 0);
    check(&a);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_waiter_restores_accounting_and_does_not_block_the_next() {
    let a = admission(running(1));
    let holder = granted(&a, ticket("h", Priority::Normal, 1));
    let gone = queued(&a, ticket("a", Priority::Normal, 500));
    let mut next = queued(&a, ticket("b", Priority::Normal, 20));
    drop(gone);
    assert_eq!((a.stats().queued, a.stats().queued_tokens), (1, 20));
    check(&a);
    drop(holder);
    assert!(matches!(poll(&mut next), Some(Ok(_))));
}

#[tokio::test(start_paused = true)]
async fn a_slot_granted_to_a_dropped_waiter_is_given_back() {
    let a = admission(running(1));
    let holder = granted(&a, ticket("h", Priority::Normal, 1));
    let first = queued(&a, ticket("a", Priority::Normal, 1));
    let mut second = queued(&a, ticket("b", Priority::Normal, 1));
    drop(holder);
    // `first` has its grant but was never polled again: the client left.
    drop(first);
    let slot = poll(&mut second);
    assert!(matches!(slot, Some(Ok(_))), "the slot moves on: {slot:?}");
    assert_eq!(a.stats().running, 1);
    drop(slot);
    assert_eq!(a.stats().running, 0);
}

#[tokio::test(start_paused = true)]
async fn raising_capacity_dispatches_and_lowering_it_lets_running_ones_finish() {
    let a = admission(running(1));
    let mut slots = vec![granted(&a, ticket("h", Priority::Normal, 1))];
    let mut waiting = vec![
        ("x", queued(&a, ticket("x", Priority::Normal, 1))),
        ("y", queued(&a, ticket("y", Priority::Normal, 1))),
        ("z", queued(&a, ticket("z", Priority::Normal, 1))),
    ];
    a.set_max_running(3);
    assert_eq!(settle(&mut waiting, &mut slots), ["x", "y"]);
    a.set_max_running(1);
    assert_eq!(a.stats().running, 3, "nothing is revoked");
    for left in [2, 1] {
        slots.pop();
        assert!(settle(&mut waiting, &mut slots).is_empty());
        assert_eq!(a.stats().running, left);
    }
    slots.pop();
    assert_eq!(settle(&mut waiting, &mut slots), ["z"]);
    check(&a);
}

#[tokio::test(start_paused = true)]
async fn close_refuses_queued_and_new_tickets() {
    let a = admission(running(1));
    let holder = granted(&a, ticket("h", Priority::Normal, 1));
    let mut f = queued(&a, ticket("a", Priority::High, 10));
    a.close();
    assert_eq!(poll(&mut f).map(|r| r.err()), Some(Some(Shed::Closed)));
    let refused = shed(&a, ticket("b", Priority::High, 1));
    assert_eq!(refused, Some(Shed::Closed));
    assert_eq!((a.stats().running, a.stats().queued, a.stats().queued_tokens), (1, 0, 0));
    drop(holder);
    assert_eq!(a.stats().running, 0, "running slots drain normally");
    check(&a);
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_queued_tokens_over_measured_throughput() {
    let a = admission(AdmissionConfig { max_queued: 1, ..running(1) });
    let done = granted(&a, ticket("h", Priority::Normal, 1000));
    tokio::time::advance(Duration::from_secs(1)).await;
    assert_eq!(a.drain_estimate(), None, "nothing measured yet");
    drop(done); // 1,000 tokens per second per slot.
    let _holder = granted(&a, ticket("h", Priority::Normal, 1));
    let mut f = queued(&a, ticket("a", Priority::Normal, 4500));
    let refused = shed(&a, ticket("b", Priority::Normal, 1));
    assert_eq!(refused.and_then(|s| s.retry_after()), Some(Duration::from_secs(5)));
    assert_eq!(a.drain_estimate(), Some(Duration::from_secs(5)), "what worker refusals are told");
    drop(f);
    f = queued(&a, ticket("a", Priority::Normal, 100_000));
    let refused = shed(&a, ticket("b", Priority::Normal, 1));
    assert_eq!(refused.and_then(|s| s.retry_after()), Some(Duration::from_secs(60)), "clamped");
    drop(f);
}

struct Waiting<'a> {
    ticket: Ticket,
    arrived: Instant,
    fut: Admit<'a>,
}

/// Random admits, slot drops, cancellations (some right after a grant,
/// before the waiter runs), time steps (some followed by a slot drop
/// before expired waiters run) and capacity changes; after each
/// step the counters must match a model built from the live futures.
async fn random_run(seed: u64) {
    let cfg = AdmissionConfig {
        max_running: 2,
        max_queued: 6,
        max_queued_tokens: 3000,
        per_key_max_queued: 3,
        per_key_max_queued_tokens: 1500,
    };
    let a = admission(cfg.clone());
    let mut rng = types::rng::XorShift64::new(seed);
    let mut max_running = cfg.max_running;
    let mut slots: Vec<Seat> = Vec::new();
    let mut waiting: Vec<Waiting<'_>> = Vec::new();
    for step in 0..400 {
        let before = a.stats();
        // The class of a ticket that may have displaced queued ones.
        let mut displacing = None;
        match rng.below(10) {
            0..=3 => {
                let t = Ticket {
                    key: format!("k{}", rng.below(4)),
                    priority: Priority::ALL[rng.below(3) as usize],
                    cost: 1 + rng.below(1200),
                    deadline: Instant::now() + Duration::from_millis(1 + rng.below(200)),
                };
                let mine = waiting.iter().filter(|w| w.ticket.key == t.key);
                let (kn, kt) = mine.fold((0, 0), |(n, c), w| (n + 1, c + w.ticket.cost));
                let key_over = kn >= cfg.per_key_max_queued || (kt > 0 && kt + t.cost > cfg.per_key_max_queued_tokens);
                let all_over = |n: usize, tokens: u64| {
                    n >= cfg.max_queued || (tokens > 0 && tokens + t.cost > cfg.max_queued_tokens)
                };
                let lower = waiting.iter().filter(|w| w.ticket.priority > t.priority);
                let (ln, lt) = lower.fold((0, 0), |(n, c), w| (n + 1, c + w.ticket.cost));
                // Room that shedding every lower-class ticket would make.
                let no_room = all_over(before.queued - ln, before.queued_tokens - lt);
                let would_displace = all_over(before.queued, before.queued_tokens).then_some(t.priority);
                let full = before.running >= max_running;
                let mut fut = admit(&a, t.clone());
                match poll(&mut fut) {
                    Some(Ok(slot)) => {
                        assert!(!full, "seed {seed} step {step}: granted past capacity");
                        slots.push(slot);
                    }
                    Some(Err(Shed::KeyLimit { .. })) => assert!(full && key_over, "seed {seed} step {step}"),
                    Some(Err(Shed::QueueFull { .. })) => {
                        assert!(full && !key_over && no_room, "seed {seed} step {step}")
                    }
                    Some(Err(e)) => panic!("seed {seed} step {step}: unexpected {e:?}"),
                    None => {
                        assert!(full && !key_over && !no_room, "seed {seed} step {step}: queued");
                        displacing = would_displace;
                        waiting.push(Waiting { ticket: t, arrived: Instant::now(), fut });
                    }
                }
            }
            4..=5 if !slots.is_empty() => drop(slots.swap_remove(rng.below(slots.len() as u64) as usize)),
            6 => {
                if !slots.is_empty() {
                    drop(slots.swap_remove(rng.below(slots.len() as u64) as usize));
                }
                if !waiting.is_empty() {
                    drop(waiting.swap_remove(rng.below(waiting.len() as u64) as usize));
                }
            }
            7..=8 => {
                tokio::time::advance(Duration::from_millis(rng.below(80))).await;
                // A slot freed before the expired waiters run: dispatch
                // must pass over them.
                if rng.below(2) == 0 && !slots.is_empty() {
                    drop(slots.swap_remove(rng.below(slots.len() as u64) as usize));
                }
            }
            9 => {
                max_running = 1 + rng.below(3) as usize;
                a.set_max_running(max_running);
            }
            _ => {}
        }
        let now = Instant::now();
        waiting.retain_mut(|w| match poll(&mut w.fut) {
            None => true,
            Some(Ok(slot)) => {
                assert!(slot.queue_wait() < w.ticket.deadline - w.arrived, "seed {seed}: granted after deadline");
                slots.push(slot);
                false
            }
            Some(Err(Shed::Deadline)) => {
                assert!(now >= w.ticket.deadline, "seed {seed}: shed before its deadline");
                false
            }
            Some(Err(Shed::QueueFull { .. })) => {
                let by = displacing.expect("displaced only by a ticket queued into a full queue");
                assert!(w.ticket.priority > by, "seed {seed} step {step}: displaced by {by:?}");
                false
            }
            Some(Err(e)) => panic!("seed {seed} step {step}: unexpected {e:?}"),
        });
        let s = a.stats();
        assert_eq!(s.running, slots.len(), "seed {seed} step {step}: running");
        assert!(s.running <= before.running || s.running <= max_running, "seed {seed} step {step}: over capacity");
        assert_eq!(s.queued, waiting.len(), "seed {seed} step {step}: queued");
        assert_eq!(s.queued_tokens, waiting.iter().map(|w| w.ticket.cost).sum::<u64>());
        let mut by_priority = [0; 3];
        waiting.iter().for_each(|w| by_priority[w.ticket.priority.index()] += 1);
        assert_eq!(s.queued_by_priority, by_priority, "seed {seed} step {step}");
        check(&a);
    }
    drop(waiting);
    drop(slots);
    assert_eq!(a.stats(), AdmissionStats { max_running, ..AdmissionStats::default() }, "seed {seed}: all back");
    assert!(a.lock().keys.is_empty(), "seed {seed}: no key state left");
}

#[tokio::test(start_paused = true)]
async fn random_sequences_keep_the_books_straight() {
    for seed in 1..=25 {
        random_run(seed).await;
    }
}
