//! The engine on its own thread, driven through `RunnerHandle` (real model).
//! Every wait is bounded and says what did not arrive; after a terminal
//! event the runner has already freed the request's blocks, so `stats()`
//! right after it is deterministic (commands are handled between steps).

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]
#![allow(clippy::disallowed_types, reason = "measures wall time on purpose (std::time::Instant)")]

mod common;

use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::{engine, greedy, run_all};
use engine::batch::{Engine, EngineConfig, Request};
use engine::runner::{
    ErrorKind, PostError, PrefillDone, Runner, RunnerConfig, RunnerError, RunnerEvent, RunnerHandle, Sink,
    COMMAND_QUEUE,
};
use engine::sampler::FinishReason;
use engine::tokenizer::Tokenizer;

const WAIT: Duration = Duration::from_secs(120);

fn cfg() -> EngineConfig {
    EngineConfig { prefix_cache: false, ..EngineConfig::default() }
}

fn spawn(cfg: EngineConfig, max_waiting: usize) -> (RunnerHandle, JoinHandle<Engine>, Tokenizer) {
    let (e, tok) = engine(cfg);
    let (h, j) = Runner::spawn(e, RunnerConfig { max_waiting }).expect("spawn runner");
    (h, j, tok)
}

fn sink() -> (Sink, Receiver<RunnerEvent>) {
    let (tx, rx) = mpsc::channel();
    // The test may have stopped listening; that is not the runner's concern.
    (Box::new(move |ev| drop(tx.send(ev))), rx)
}

fn req(id: u64, prompt: &[u32], max_tokens: u32) -> Request {
    Request {
        id,
        prompt: prompt.to_vec(),
        params: greedy(max_tokens),
        salt: 0,
        priority: Default::default(),
        generated: Vec::new(),
    }
}

/// Reads events until the terminal one; returns the tokens and that event.
fn drain(rx: &Receiver<RunnerEvent>, what: &str) -> (Vec<u32>, RunnerEvent) {
    let mut tokens = Vec::new();
    loop {
        match rx.recv_timeout(WAIT) {
            Ok(RunnerEvent::Token(t)) => tokens.push(t.id),
            Ok(terminal) => {
                // Exactly one terminal event: nothing may follow it.
                assert!(rx.try_recv().is_err(), "{what}: an event arrived after the terminal one");
                return (tokens, terminal);
            }
            Err(e) => panic!("{what}: no terminal event within {WAIT:?} ({e}); got {} tokens", tokens.len()),
        }
    }
}

fn stats_used(h: &RunnerHandle) -> usize {
    h.stats().expect("runner alive").kv.used
}

fn join(j: JoinHandle<Engine>) -> Engine {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || drop(tx.send(j.join())));
    rx.recv_timeout(WAIT).expect("runner thread did not exit after shutdown").expect("runner thread panicked")
}

fn prompts(tok: &Tokenizer, texts: &[&str]) -> Vec<Vec<u32>> {
    texts.iter().map(|t| tok.encode(t, false).expect("encode")).collect()
}

#[test]
fn concurrent_submits_match_a_plain_engine() {
    let (h, j, tok) = spawn(cfg(), 16);
    let ps = prompts(
        &tok,
        &["Hello", "The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Rust is", "The sky is blue because"],
    );
    let (mut plain, _) = engine(cfg());
    let reference = run_all(&mut plain, &ps, &greedy(8));

    let workers: Vec<_> = (0..3)
        .map(|t| {
            let h = h.clone();
            let ps = ps.clone();
            std::thread::spawn(move || {
                let rxs: Vec<_> = (2 * t..2 * t + 2)
                    .map(|i| {
                        let (s, rx) = sink();
                        h.submit(req(i as u64, &ps[i], 8), None, s).expect("submit accepted");
                        (i, rx)
                    })
                    .collect();
                rxs.into_iter()
                    .map(|(i, rx)| {
                        let (toks, end) = drain(&rx, &format!("request {i}"));
                        assert_eq!(
                            end,
                            RunnerEvent::Finished { reason: FinishReason::Length, cached_prompt_tokens: 0 },
                            "request {i}"
                        );
                        (i, toks)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for w in workers {
        for (i, toks) in w.join().expect("submitter thread") {
            assert_eq!(toks, reference[i], "request {i} differs from the plain engine");
        }
    }
    let s = h.stats().expect("stats");
    assert_eq!((s.finished, s.kv.used, s.running, s.waiting), (6, 0, 0, 0), "{s:?}");
    assert!(s.failed_by_kind.is_empty(), "{s:?}");
    h.shutdown(Duration::ZERO);
    assert_eq!(join(j).kv_stats().used, 0);
}

#[test]
fn abort_deadline_and_a_panicking_sink_free_everything() {
    let (h, j, tok) = spawn(cfg(), 16);
    let p = prompts(&tok, &["The capital of France is"]).remove(0);

    // Abort mid-stream.
    let (s, rx) = sink();
    h.submit(req(1, &p, 2000), None, s).expect("submit");
    assert!(matches!(rx.recv_timeout(WAIT), Ok(RunnerEvent::Token(_))), "no first token for request 1");
    assert!(h.abort(1), "request 1 is in flight");
    let (_, end) = drain(&rx, "aborted request");
    assert_eq!(end, RunnerEvent::Failed(RunnerError::Cancelled));
    assert_eq!(stats_used(&h), 0, "abort frees the blocks");
    assert!(!h.abort(1), "already gone");

    // A deadline already past: failed before any work.
    let past = Instant::now().checked_sub(Duration::from_secs(1)).unwrap_or_else(Instant::now);
    let (s, rx) = sink();
    h.submit(req(2, &p, 8), Some(past), s).expect("submit");
    let (toks, end) = drain(&rx, "request past its deadline");
    assert_eq!((toks.len(), end), (0, RunnerEvent::Failed(RunnerError::Deadline)));
    // A very short one: expires mid-stream (2000 tokens cannot fit in 50 ms).
    let (s, rx) = sink();
    h.submit(req(3, &p, 2000), Some(Instant::now() + Duration::from_millis(50)), s).expect("submit");
    let (_, end) = drain(&rx, "request with a short deadline");
    assert_eq!(end, RunnerEvent::Failed(RunnerError::Deadline));
    // Prefill-only requests get theirs through on_done.
    let (tx, prx) = mpsc::channel();
    h.submit_prefill_only(req(4, &p, 8), Some(past), Box::new(move |r| drop(tx.send(r)))).expect("submit");
    let r = prx.recv_timeout(WAIT).expect("prefill-only request 4 got no answer");
    assert_eq!(r, Err(RunnerError::Deadline));
    assert_eq!(stats_used(&h), 0, "expired requests leak nothing");

    // A sink that panics is a client gone: aborted, thread alive.
    let (tx, seen) = mpsc::channel();
    h.submit(
        req(5, &p, 50),
        None,
        Box::new(move |_| {
            let _ = tx.send(());
            panic!("client went away");
        }),
    )
    .expect("submit");
    seen.recv_timeout(WAIT).expect("the panicking sink was never called");
    let s = h.stats().expect("runner thread survived the panic");
    assert_eq!((s.kv.used, s.running), (0, 0), "{s:?}");
    assert_eq!(s.failed_by_kind.get(&ErrorKind::Cancelled), Some(&2), "abort + panicking sink: {s:?}");
    assert_eq!(s.failed_by_kind.get(&ErrorKind::Deadline), Some(&3), "{s:?}");

    // Invalid input is answered synchronously.
    let (s, _rx) = sink();
    let err = h.submit(req(6, &[], 8), None, s).expect_err("empty prompt");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    let (s, rx) = sink();
    h.submit(req(7, &p, 3), None, s).expect("still serving");
    assert_eq!(
        drain(&rx, "request after the panic").1,
        RunnerEvent::Finished { reason: FinishReason::Length, cached_prompt_tokens: 0 }
    );
    h.shutdown(Duration::ZERO);
    assert_eq!(join(j).kv_stats().used, 0);
}

#[test]
fn overload_is_synchronous_and_zero_grace_fails_in_flight() {
    let (h, j, tok) = spawn(EngineConfig { max_running: 1, ..cfg() }, 1);
    let p = prompts(&tok, &["Once upon a time"]).remove(0);
    let (s1, rx1) = sink();
    let (s2, rx2) = sink();
    let (s3, _rx3) = sink();
    h.submit(req(1, &p, 2000), None, s1).expect("first takes the seat");
    h.submit(req(2, &p, 2000), None, s2).expect("second waits");
    let err = h.submit(req(3, &p, 2000), None, s3).expect_err("third is over the bound");
    assert_eq!(err, RunnerError::Overloaded { waiting: 1, max_waiting: 1 });
    assert_eq!(err.kind(), ErrorKind::Overloaded);

    h.shutdown(Duration::ZERO);
    for (rx, what) in [(&rx1, "running request"), (&rx2, "waiting request")] {
        assert_eq!(drain(rx, what).1, RunnerEvent::Failed(RunnerError::ShuttingDown), "{what}");
    }
    let e = join(j);
    assert_eq!((e.kv_stats().used, e.has_work()), (0, false));
    let (s, _rx) = sink();
    assert_eq!(h.submit(req(4, &p, 2), None, s), Err(RunnerError::ShuttingDown), "thread gone");
    assert!(h.stats().is_none());
}

/// A prompt seen before reports the prompt tokens it took from the prefix
/// cache (whole blocks, at least one token left to compute); a new one 0.
#[test]
fn a_repeated_prompt_reports_its_cached_prompt_tokens() {
    let (h, j, tok) = spawn(EngineConfig { prefix_cache: true, ..EngineConfig::default() }, 16);
    let long = "The lighthouse keeper climbed the stairs every evening. ".repeat(8);
    let p = prompts(&tok, &[long.as_str()]).remove(0);
    let block_size = h.block_size();
    let mut ends = Vec::new();
    let mut outputs = Vec::new();
    for i in 0..2u64 {
        let (s, rx) = sink();
        h.submit(req(i, &p, 4), None, s).expect("submit");
        let (toks, end) = drain(&rx, &format!("run {i}"));
        outputs.push(toks);
        ends.push(end);
    }
    let expect_cached = (p.len() - 1) / block_size * block_size;
    assert!(expect_cached > 0, "the prompt spans whole blocks ({} tokens, block {block_size})", p.len());
    assert_eq!(
        ends,
        [
            RunnerEvent::Finished { reason: FinishReason::Length, cached_prompt_tokens: 0 },
            RunnerEvent::Finished { reason: FinishReason::Length, cached_prompt_tokens: expect_cached },
        ]
    );
    assert_eq!(outputs[0], outputs[1], "the cached run generates the same tokens");
    h.shutdown(Duration::ZERO);
    join(j);
}

#[test]
fn shutdown_with_grace_finishes_in_flight_and_refuses_new_work() {
    let (h, j, tok) = spawn(cfg(), 16);
    let ps = prompts(&tok, &["Hello", "Rust is"]);
    let rxs: Vec<_> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (s, rx) = sink();
            h.submit(req(i as u64, p, 6), None, s).expect("submit");
            rx
        })
        .collect();
    h.shutdown(Duration::from_secs(600));
    let (s, _rx) = sink();
    assert_eq!(h.submit(req(9, &ps[0], 2), None, s), Err(RunnerError::ShuttingDown));
    assert_eq!(h.reserve(1), Err(RunnerError::ShuttingDown));
    for (i, rx) in rxs.iter().enumerate() {
        let (toks, end) = drain(rx, &format!("request {i} during the drain"));
        assert_eq!(
            (toks.len(), end),
            (6, RunnerEvent::Finished { reason: FinishReason::Length, cached_prompt_tokens: 0 }),
            "request {i}"
        );
    }
    assert_eq!(join(j).kv_stats().used, 0);
}

#[test]
fn prefill_runner_to_decode_runner_equals_one_engine() {
    let (e, tok) = engine(cfg());
    let layers = e.model().config().n_layers;
    let (prefill, pj) = Runner::spawn(e, RunnerConfig::default()).expect("spawn prefill");
    let (decode, dj, _) = spawn(cfg(), 16);
    let long = "The lighthouse keeper climbed the stairs every evening. ".repeat(20);
    let ps = prompts(&tok, &["Hello", "The capital of France is", long.as_str()]);
    let (mut single, _) = engine(cfg());
    let reference = run_all(&mut single, &ps, &greedy(10));

    for (i, p) in ps.iter().enumerate() {
        let id = i as u64;
        let (tx, rx) = mpsc::channel();
        prefill.submit_prefill_only(req(id, p, 10), None, Box::new(move |r| drop(tx.send(r)))).expect("prefill");
        let PrefillDone { first, blocks: src, cached_prompt_tokens } =
            rx.recv_timeout(WAIT).expect("prefill-only request never finished").expect("prefill ok");
        assert_eq!(src.len(), prefill.blocks_for(p.len()));
        assert_eq!(cached_prompt_tokens, 0, "no prefix cache, nothing cached");

        let dst = decode.reserve(decode.blocks_for(p.len())).expect("reserve");
        let kv = prefill
            .with_pool(move |pool| (0..layers).map(|l| pool.gather_layer(l, &src)).collect::<Result<Vec<_>, _>>())
            .expect("runner alive")
            .expect("gather");
        let dst2 = dst.clone();
        decode
            .with_pool(move |pool| kv.iter().enumerate().try_for_each(|(l, (k, v))| pool.scatter_layer(l, &dst2, k, v)))
            .expect("runner alive")
            .expect("scatter");
        assert!(prefill.release_held(id));
        assert_eq!(stats_used(&prefill), 0, "prefill side keeps nothing after the transfer");

        let (s, srx) = sink();
        decode.submit_prefilled(req(id, p, 10), dst, first.clone(), None, s).expect("join");
        let (toks, end) = drain(&srx, &format!("decode of prompt {i}"));
        assert_eq!(end, RunnerEvent::Finished { reason: FinishReason::Length, cached_prompt_tokens: 0 });
        let out: Vec<u32> = std::iter::once(first.id).chain(toks).collect();
        assert_eq!(out, reference[i], "prompt {i} ({} tokens)", p.len());
        assert_eq!(stats_used(&decode), 0);
    }

    // Blocks that were never reserved cannot be released or joined.
    let err = decode.release_reserved(vec![0]).expect_err("block 0 is not reserved");
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    // Reservations still out at shutdown are freed with everything else.
    decode.reserve(2).expect("reserve");
    decode.shutdown(Duration::ZERO);
    prefill.shutdown(Duration::ZERO);
    assert_eq!(join(dj).kv_stats().used, 0);
    assert_eq!(join(pj).kv_stats().used, 0);
}

/// The command queue is bounded and `post_pool` never waits on it: with the
/// runner thread held inside a job, posts fill the queue, the next one is
/// refused `Full` at once (and dropped unrun), and every queued job runs,
/// in order, once the thread is free. An ask made meanwhile (which waits
/// for room as it waits for its answer) is answered.
#[test]
fn post_pool_refuses_a_full_queue_at_once_and_runs_what_it_queued_in_order() {
    let (h, j, _) = spawn(cfg(), 4);
    let (entered_tx, entered) = mpsc::channel();
    let (open_tx, open) = mpsc::channel::<()>();
    h.post_pool(move |_| {
        let _ = entered_tx.send(());
        let _ = open.recv_timeout(WAIT);
    })
    .expect("the gate job is queued");
    entered.recv_timeout(WAIT).expect("the runner thread never took the gate job");

    let ran = Arc::new(Mutex::new(Vec::new()));
    for i in 0..COMMAND_QUEUE {
        let ran = ran.clone();
        h.post_pool(move |_| ran.lock().expect("ran").push(i)).unwrap_or_else(|e| panic!("post {i}: {e}"));
    }
    let refused = Arc::new(Mutex::new(false));
    let flag = refused.clone();
    let t = Instant::now();
    assert_eq!(
        h.post_pool(move |_| *flag.lock().expect("flag") = true),
        Err(PostError::Full { capacity: COMMAND_QUEUE })
    );
    assert!(t.elapsed() < Duration::from_secs(1), "post_pool waited {:?} on a full queue", t.elapsed());

    let asker = {
        let h = h.clone();
        std::thread::spawn(move || h.stats().map(|s| s.kv.used))
    };
    open_tx.send(()).expect("the gate job is waiting");
    assert_eq!(asker.join().expect("asker"), Some(0), "the ask made while the queue was full is answered");
    h.with_pool(|_| ()).expect("barrier");
    assert_eq!(*ran.lock().expect("ran"), (0..COMMAND_QUEUE).collect::<Vec<_>>(), "every queued job ran, in order");
    assert!(!*refused.lock().expect("flag"), "the refused job never runs");
    h.shutdown(Duration::ZERO);
    assert_eq!(join(j).kv_stats().used, 0);
    assert_eq!(h.post_pool(|_| {}), Err(PostError::Exited));
}

/// A request's sink queue sized by `max_events` holds every event it can
/// get: one per token (at most `max_tokens`, at most the context) plus the
/// terminal one.
#[test]
fn max_events_counts_every_token_and_the_terminal_event() {
    let (e, _) = engine(cfg());
    let context = e.model().config().context;
    let (h, j) = Runner::spawn(e, RunnerConfig::default()).expect("spawn runner");
    assert_eq!(h.max_events(5), 6);
    assert_eq!(h.max_events(u32::MAX), context + 1);
    let p = vec![1u32; 3];
    let (s, rx) = sink();
    h.submit(req(1, &p, 7), None, s).expect("submit");
    let (tokens, end) = drain(&rx, "max_events request");
    assert!(tokens.len() < h.max_events(7), "{} tokens and {end:?} within {}", tokens.len(), h.max_events(7));
    h.shutdown(Duration::ZERO);
    join(j);
}

/// Through the runner, prompt lookup streams several tokens of one request per step
/// as single events, exactly plain decoding's, and the stats count drafted and
/// accepted tokens (what workers export as `tandem_spec_decode_*`).
#[test]
fn prompt_lookup_through_the_runner_streams_plain_tokens_and_counts_drafts() {
    let (h, j, tok) = spawn(EngineConfig { prompt_lookup: 6, ..cfg() }, 4);
    let p = prompts(&tok, &["one two three four five six seven eight one two three four five six seven eight one two"]);
    let (mut plain, _) = engine(cfg());
    let reference = run_all(&mut plain, &p, &greedy(24));
    assert_eq!(h.stats().expect("stats").draft_tokens, (0, 0));
    let (s, rx) = sink();
    h.submit(req(1, &p[0], 24), None, s).expect("submit accepted");
    let (toks, end) = drain(&rx, "request 1");
    assert_eq!(end, RunnerEvent::Finished { reason: FinishReason::Length, cached_prompt_tokens: 0 });
    assert_eq!(toks, reference[0]);
    let (drafted, accepted) = h.stats().expect("stats").draft_tokens;
    assert!(accepted > 5 && drafted >= accepted, "{accepted} of {drafted} accepted");
    h.shutdown(Duration::ZERO);
    assert_eq!(join(j).kv_stats().used, 0);
}

/// The load a handle reads without asking the runner (`load_now`, what a worker pushes
/// to its watchers) is the runner's as of its last turn: a sequence running while the
/// runner is held mid-turn by its sink, and nothing once it ended, with the blocks the
/// pool counts.
#[test]
fn the_published_load_follows_the_running_batch_between_turns() {
    let (h, j, tok) = spawn(cfg(), 8);
    assert_eq!(h.load_now(), engine::runner::LoadNow::default(), "idle at start");
    let prompt = &prompts(&tok, &["The history of Paris is long and rich, and its rivers"])[0];
    // The sink holds the runner inside the turn of the second token until released.
    let (tx, rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let mut n = 0;
    let held: Sink = Box::new(move |ev| {
        let token = matches!(ev, RunnerEvent::Token(_));
        drop(tx.send(ev));
        n += usize::from(token);
        if n == 2 {
            // Released by the test, or at WAIT if the test failed first.
            let _ = go_rx.recv_timeout(WAIT);
        }
    });
    h.submit(req(1, prompt, 8), None, held).expect("submit");
    for _ in 0..2 {
        assert!(matches!(rx.recv_timeout(WAIT), Ok(RunnerEvent::Token(_))), "a token");
    }
    // The first token's turn was published; the second's is not over.
    let during = h.load_now();
    assert_eq!((during.running, during.waiting), (1, 0), "{during:?}");
    let blocks = prompt.len().div_ceil(EngineConfig::default().block_size);
    assert!(during.kv_used as usize >= blocks, "{during:?} for a {}-token prompt", prompt.len());
    go_tx.send(()).expect("release the runner");
    let (_, end) = drain(&rx, "the held request");
    assert!(matches!(end, RunnerEvent::Finished { .. }), "{end:?}");
    // A command is answered between turns, so after the answer the last turn is published.
    let used = stats_used(&h);
    assert_eq!(h.load_now(), engine::runner::LoadNow { running: 0, waiting: 0, kv_used: used as u32 });
    h.shutdown(Duration::ZERO);
    join(j);
}
