use super::*;
use crate::load::Load;
use proto::worker::v1::decode_worker_server::{DecodeWorker, DecodeWorkerServer};
use proto::worker::v1::{
    AbortRequest, AbortResponse, FinishReason, Finished, GenerateResponse, HealthRequest, HealthResponse, PrefixUpdate,
    TokenChunk, WatchPrefixesRequest,
};
use proto::worker::v1::{ErrorKind, WorkerError};
use tonic::{Request, Response, Status};

fn cluster(decode: &[&str], prefill: &[&str]) -> Cluster {
    let source = Source::Static {
        decode: decode.iter().map(|s| (*s).to_owned()).collect(),
        prefill: prefill.iter().map(|s| (*s).to_owned()).collect(),
    };
    let settings = RouteSettings {
        breaker: BreakerConfig { failures: 3, cooldown: Duration::from_secs(60), open_group_prefills_locally: false },
        ..RouteSettings::default()
    };
    Cluster::new(source, settings).expect("a cluster")
}

fn failed(prefill: &str) -> PrefillAttempt {
    PrefillAttempt {
        target: Some(PrefillTarget { worker_id: prefill.into(), grpc_addr: prefill.into() }),
        error: Some(WorkerError { kind: ErrorKind::KvLoadFailed as i32, message: "link".into() }),
        reason: "timeout".into(),
    }
}

#[test]
fn a_failure_reported_via_one_decode_worker_does_not_change_routing_for_another() {
    let c = cluster(&["127.0.0.1:1", "127.0.0.1:2"], &["127.0.0.1:9"]);
    // decode worker 1's link is bad: three failed attempts on the only prefill worker.
    for _ in 0..3 {
        c.record_prefill_attempts("127.0.0.1:1", "127.0.0.1:1", &[failed("127.0.0.1:9")]);
    }
    for _ in 0..20 {
        let r = c.route(100).expect("decode worker 2's pair is closed");
        assert_eq!(r.decode, "127.0.0.1:2", "decode worker 1 has no usable pair: {r:?}");
        assert_eq!(r.prefill.len(), 1);
        assert_eq!(r.prefill[0].grpc_addr, "127.0.0.1:9");
    }
    // Short prompts need no pair: both decode workers still take them.
    assert_eq!(c.route(10).expect("a local route").decode, "127.0.0.1:1");
    // The same prefill worker failing for decode worker 2 too: every pair is open.
    for _ in 0..3 {
        c.record_prefill_attempts("127.0.0.1:2", "127.0.0.1:2", &[failed("127.0.0.1:9")]);
    }
    let e = c.route(100).expect_err("no usable pair");
    assert!(matches!(e, Error::NoRoute { why: NoRoute::PrefillUnavailable(_), .. }), "{e:?}");
}

/// A decode worker whose streams break before their first message (`broken`: the
/// status a reset connection gives), or answer one token and finish.
/// Each request a fake decode worker got: its id and how many prefill workers it listed.
type Seen = Arc<Mutex<Vec<(String, usize)>>>;

struct Fake {
    broken: bool,
    ids: Seen,
}

#[tonic::async_trait]
impl DecodeWorker for Fake {
    type GenerateStream = tokio_stream::Iter<std::vec::IntoIter<Result<GenerateResponse, Status>>>;

    async fn generate(&self, r: Request<GenerateRequest>) -> Result<Response<Self::GenerateStream>, Status> {
        let r = r.into_inner();
        self.ids.lock().unwrap_or_else(|e| e.into_inner()).push((r.request_id, r.prefill.len()));
        let event = |e| Ok(GenerateResponse { event: Some(e), prefill_attempts: Vec::new() });
        let events = if self.broken {
            vec![Err(Status::unavailable("error reading a body from connection: connection reset by peer"))]
        } else {
            vec![
                event(generate_response::Event::Token(TokenChunk {
                    id: 7,
                    logprob: None,
                    top: Vec::new(),
                    index: None,
                })),
                event(generate_response::Event::Finished(Finished {
                    reason: FinishReason::Length as i32,
                    prompt_tokens: 3,
                    generated_tokens: 1,
                    prefilled_remotely: false,
                    cached_prompt_tokens: 0,
                    seed: 0,
                })),
            ]
        };
        Ok(Response::new(tokio_stream::iter(events)))
    }

    async fn abort(&self, _: Request<AbortRequest>) -> Result<Response<AbortResponse>, Status> {
        Ok(Response::new(AbortResponse { found: false }))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthResponse>, Status> {
        Ok(Response::new(HealthResponse { live: true, ready: true, ..HealthResponse::default() }))
    }

    type WatchPrefixesStream = tokio_stream::Empty<Result<PrefixUpdate, Status>>;

    /// A worker of a release before the RPC: the coordinator reads its Health reports.
    async fn watch_prefixes(
        &self,
        _: Request<WatchPrefixesRequest>,
    ) -> Result<Response<Self::WatchPrefixesStream>, Status> {
        Err(Status::unimplemented("WatchPrefixes"))
    }
}

async fn serve(broken: bool) -> (String, Seen) {
    let ids = Arc::new(Mutex::new(Vec::new()));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr").to_string();
    let svc = DecodeWorkerServer::new(Fake { broken, ids: ids.clone() });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(l)),
    );
    (addr, ids)
}

fn idle(running: u32) -> Load {
    Load {
        ready: true,
        reachable: true,
        kv_blocks_total: 100,
        kv_blocks_used: 0,
        running,
        waiting: 0,
        at: tokio::time::Instant::now(),
    }
}

/// A stream that breaks before its first message reached nobody: the request goes to
/// another decode worker instead of ending in a `worker_stream` error, under an id of
/// its own (a worker still holding the broken attempt would refuse the same id).
#[tokio::test]
async fn a_stream_broken_before_its_first_message_is_routed_again() {
    let (broken, broken_ids) = serve(true).await;
    let (fine, fine_ids) = serve(false).await;
    let source = Source::Static { decode: vec![broken.clone(), fine.clone()], prefill: Vec::new() };
    let c = Arc::new(Cluster::new(source, RouteSettings::default()).expect("cluster"));
    // The broken worker looks idlest, so it is tried first.
    c.board().set(&broken, idle(0));
    c.board().set(&fine, idle(5));
    let params = SamplingParams { max_tokens: 1, ..SamplingParams::default() };
    let dispatch = Dispatch {
        request_id: "r1".into(),
        prompt: vec![1, 2, 3],
        generated: Vec::new(),
        params,
        deadline_unix_ms: 0,
        tags: WorkerTags { cache_salt: 7, priority: Priority::Low },
        pin: None,
    };
    let (mut stream, _inflight) = c.generate(dispatch).await.map_err(|e| e.to_string()).expect("routed again");
    let first = stream.message().await.expect("a message").and_then(|m| m.event);
    assert!(matches!(first, Some(generate_response::Event::Token(TokenChunk { id: 7, .. }))), "{first:?}");
    let ids = |m: &Mutex<Vec<(String, usize)>>| {
        m.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(id, _)| id.clone()).collect::<Vec<_>>()
    };
    assert_eq!((ids(&broken_ids), ids(&fine_ids)), (vec!["r1".to_owned()], vec!["r1.2".to_owned()]));
    assert!(c.board().get(&broken).is_some_and(|l| !l.reachable), "the broken worker is marked unreachable");
}

/// A worker whose stream broke in this dispatch is not tried again while another can
/// serve, even when the board shows it usable (a poll answered before it died); with no
/// other, it is still the last resort (a reset connection to a live worker).
#[tokio::test]
async fn a_dispatch_avoids_the_worker_whose_stream_broke_while_another_serves() {
    let (a, b) = ("127.0.0.1:1", "127.0.0.1:2");
    let c = cluster(&[a, b], &[]);
    c.board().set(a, idle(0));
    c.board().set(b, idle(5));
    let tokens = [1, 2, 3];
    let route = |avoid: &[&str]| {
        let avoid: Vec<String> = avoid.iter().map(|s| (*s).to_owned()).collect();
        c.route_pinned(&tokens, 7, None, &avoid).map(|r| r.decode).map_err(|e| e.to_string())
    };
    assert_eq!(route(&[]), Ok(a.to_owned()), "the idlest first");
    assert_eq!(route(&[a]), Ok(b.to_owned()), "the broken one avoided although it looks idlest");
    c.board().mark_unreachable(b);
    assert_eq!(route(&[a]), Ok(a.to_owned()), "nothing else serves: the avoided one after all");
    c.board().mark_unreachable(a);
    assert!(route(&[a]).is_err(), "no worker at all is still refused");
}

/// Retries inside the cluster happen in one layer: a dispatch lists at most
/// `prefill_attempts` prefill workers across every decode worker it tries, so a
/// decode worker's walk of its list (policy `retry`) and the coordinator's routing
/// again never multiply; with none left, routing again stops.
#[tokio::test]
async fn a_dispatch_spends_one_budget_of_prefill_attempts_across_decode_workers() {
    let prefill = ["127.0.0.1:9", "127.0.0.1:10", "127.0.0.1:11"].map(String::from);
    for (budget, want) in [(4, Ok(vec![3, 1])), (3, Err(3))] {
        let (broken, broken_seen) = serve(true).await;
        let (fine, fine_seen) = serve(false).await;
        let source = Source::Static { decode: vec![broken.clone(), fine.clone()], prefill: prefill.to_vec() };
        let settings =
            RouteSettings { local_prefill_max_tokens: 0, prefill_attempts: budget, ..RouteSettings::default() };
        let c = Arc::new(Cluster::new(source, settings).expect("cluster"));
        c.board().set(&broken, idle(0));
        c.board().set(&fine, idle(5));
        for p in &prefill {
            c.board().set(p, idle(0));
        }
        let dispatch = Dispatch {
            request_id: "r1".into(),
            prompt: vec![1, 2, 3],
            generated: Vec::new(),
            params: SamplingParams { max_tokens: 1, ..SamplingParams::default() },
            deadline_unix_ms: 0,
            tags: WorkerTags { cache_salt: 7, priority: Priority::Low },
            pin: None,
        };
        let r = c.generate(dispatch).await.map(|_| ()).map_err(|e| e.to_string());
        let seen = |m: &Seen| m.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(_, n)| *n).collect::<Vec<_>>();
        let lists: Vec<usize> = seen(&broken_seen).into_iter().chain(seen(&fine_seen)).collect();
        match want {
            Ok(want) => {
                assert!(r.is_ok(), "budget {budget}: {r:?}");
                assert_eq!(lists, want, "budget {budget}: the lists sent");
            }
            Err(first) => {
                assert_eq!(lists, vec![first], "budget {budget}: one list, then nothing left to route with");
                assert!(r.as_ref().is_err_and(|e| e.contains("prefill attempts are spent")), "{r:?}");
            }
        }
    }
}

/// The client of a decode worker that left (a restart comes back at another address) is
/// dropped by the poller's round unless a request of ours still runs on it.
#[tokio::test]
async fn clients_of_departed_decode_workers_are_dropped_once_idle() {
    let c = cluster(&["127.0.0.1:1001", "127.0.0.1:1002"], &[]);
    for addr in ["127.0.0.1:1001", "127.0.0.1:1002", "127.0.0.1:2001", "127.0.0.1:2002"] {
        c.decode_entry(addr).expect("a client");
    }
    let busy = c.decode_entry("127.0.0.1:2002").expect("a client");
    busy.inflight.fetch_add(1, Ordering::Relaxed);
    assert_eq!(c.decode_clients(), 4);
    assert_eq!(c.forget_departed(&c.poll_targets()), 1, "the idle departed worker's client goes");
    assert_eq!(c.decode_clients(), 3);
    busy.inflight.fetch_sub(1, Ordering::Relaxed);
    assert_eq!(c.forget_departed(&c.poll_targets()), 1, "then the other, once its request ended");
    assert_eq!(c.forget_departed(&c.poll_targets()), 0, "members keep theirs");
    assert_eq!(c.decode_clients(), 2);
}

/// A fleet past [`listing::LIST_ALL_UP_TO`] decode workers: `decode` of them (the first
/// `ready` ready, the rest not) and `prefill` prefill workers, every one with a load.
fn large(decode: usize, ready: usize, prefill: usize) -> (Cluster, Vec<String>) {
    let d: Vec<String> = (0..decode).map(|i| format!("127.0.0.1:{}", 10_000 + i)).collect();
    let p: Vec<String> = (0..prefill).map(|i| format!("127.0.0.1:{}", 20_000 + i)).collect();
    let c =
        cluster(&d.iter().map(String::as_str).collect::<Vec<_>>(), &p.iter().map(String::as_str).collect::<Vec<_>>());
    for (i, a) in d.iter().enumerate() {
        c.board().set(a, Load { ready: i < ready, ..idle(2) });
    }
    for a in &p {
        c.board().set(a, idle(0));
    }
    (c, d)
}

/// Sampled or not, the worker holding the prompt is always among the candidates, and at
/// equal load it wins every time.
#[test]
fn a_large_fleet_is_sampled_yet_the_prompts_holder_always_wins() {
    let (c, d) = large(200, 200, 0);
    let prompt: Vec<u32> = (0..100).map(|t| 500 + t).collect();
    let holder = &d[137];
    c.board().set_prefixes(holder, 16, engine::kv::prefix_hashes(&prompt[..99], 16, 7));
    for _ in 0..50 {
        assert_eq!(&c.route_for(&prompt, 7).expect("a route").decode, holder);
    }
}

/// A sample that finds no ready decode worker is not the answer: the fleet is listed
/// whole and the one ready worker found, every time.
#[test]
fn a_sample_that_finds_no_ready_worker_falls_back_to_listing_all() {
    let (c, d) = large(200, 1, 0);
    for _ in 0..50 {
        assert_eq!(c.route(10).expect("a route").decode, d[0]);
    }
}

/// A sampled decision names as many prefill workers as a dispatch tries, of the chosen
/// decode worker's group, and spreads over the fleet.
#[test]
fn a_sampled_decision_names_a_full_list_of_prefill_workers() {
    let (c, _) = large(200, 200, 100);
    let mut chosen = std::collections::HashSet::new();
    for _ in 0..50 {
        let r = c.route(500).expect("a route");
        assert_eq!(r.prefill.len(), RouteSettings::default().prefill_attempts);
        let mut names: Vec<&str> = r.prefill.iter().map(|p| p.grpc_addr.as_str()).collect();
        names.dedup();
        assert_eq!(names.len(), r.prefill.len(), "no worker twice: {names:?}");
        chosen.insert(r.decode);
    }
    // All equally loaded: the sample spreads them (one worker for all 50 would mean no sample).
    assert!(chosen.len() > 10, "{} decode workers chosen in 50 decisions", chosen.len());
}
