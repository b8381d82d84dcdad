//! `tandem bench handoff`: what handing a prompt's KV from a prefill engine
//! to a decode engine costs beyond moving its bytes, over one KV transport
//! (`--transport`: tcp, quic, local or ucx) on this host, for several prompt
//! lengths, in one process on one clock.
//!
//! Per prompt length and repetition, interleaved:
//! - **raw**: the prompt's KV bytes (every layer's K and V of its blocks)
//!   over the same transport with no engine: pre-filled layers sent by the
//!   transport's sender into blocks reserved in B's pool, timed from the
//!   first frame to the `Ack`; for tcp also over a plain loopback TCP
//!   connection, 1 MiB writes, read into one destination buffer (what any
//!   TCP hand-off has to pay at least), which is then the baseline;
//! - **hand-off**: a real streaming prefill on engine A whose layers go out
//!   as they are computed (tcp: checksummed on A's thread and sent straight
//!   from A's pool, `--tcp-pinned`, the default; the others: gathered into
//!   recycled buffers on A's thread; as the prefill worker does) through the transport's sender to its server,
//!   which lands each accepted frame in B's pool as the decode worker does
//!   (tcp: read straight into the pool, `--tcp-direct`, the default; the
//!   others: the sink posts it to B's thread, which writes it); then, as the
//!   prefill worker does once the prefill is
//!   done, `Complete`/`Ack`, `take_ready` and `add_prefilled` on B. Timed
//!   from A's prefill done (its last layer written and its first token
//!   sampled: the earliest moment any design can answer) to B holding the
//!   sequence with its KV, ready to stream token 0: the transfer still in
//!   flight, the acknowledgement and the join; the prefill's compute is not
//!   in it. Beside it: A's compute after its last KV write (the rest of the
//!   last layer, the logits, the sampling), which a streaming transfer
//!   overlaps, and B's first decode step (token 1).
//!
//! The target at 1,024 tokens: hand-off ≤ 1.3 × raw + 1 ms.

#![allow(clippy::disallowed_types, reason = "a benchmark: wall time on purpose")]

use std::path::PathBuf;
use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use engine::batch::{Engine, EngineConfig, LayerView, Request};
use engine::model::Model;
use engine::sampler::SampledToken;
use kvtransfer::transport::{DirectPool, PoolMemory};
use kvtransfer::{
    BlockSink, Buffer, Buffers, KvSender, KvServer, LayoutFingerprint, LocalSenderConfig, LocalServerConfig,
    OwnedPayload, Peer, PeerTrust, PinnedLayer, QuicSenderConfig, QuicServerConfig, Receiver, ReceiverConfig,
    Reservation, SenderConfig, ServerConfig, TcpSenderConfig, TcpServerConfig, TlsIdentity, TransportKind,
    UcxSenderConfig, UcxServerConfig, VersionGroup, WriteInstruction,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use types::kv::{BlockId, KvLayout};
use types::sampling::SamplingParams;

#[derive(clap::Args)]
pub struct Args {
    /// GGUF model (default: the cached SmolLM2 file).
    #[arg(long, env = "TANDEM_MODEL")]
    model: Option<PathBuf>,
    /// Model compute threads of each engine.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Prompt lengths, tokens.
    #[arg(long, value_delimiter = ',', default_value = "128,1024,4096")]
    prompt_tokens: Vec<usize>,
    /// Repetitions per length (medians are printed, with min and max).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// The KV transport: tcp, quic, local or ucx.
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// tcp: read each payload straight into B's pool, as decode workers do
    /// by default (`tcp_direct`); false: into buffers B's thread writes.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    tcp_direct: bool,
    /// tcp: A's pool in mapped memory, each layer checksummed on A's thread and sent
    /// straight from its blocks, as prefill workers do by default (`tcp_pinned`);
    /// false: gathered into recycled buffers on A's thread.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    tcp_pinned: bool,
}

/// Blocks of each engine's pool: a 4,096-token prompt and room to spare.
const KV_BLOCKS: usize = 512;
/// Bytes per write of the raw baseline.
const PIECE: usize = 1 << 20;

pub fn run(a: &Args) -> Result<()> {
    if a.threads == 0 || a.reps == 0 || a.prompt_tokens.iter().any(|n| *n < 2) {
        bail!("--threads and --reps must be positive, every --prompt-tokens at least 2");
    }
    let kind = TransportKind::parse(&a.transport)
        .ok_or_else(|| anyhow!("--transport {:?}: use tcp, quic, local or ucx", a.transport))?;
    if kind == TransportKind::Ucx && std::env::var_os("UCX_NET_DEVICES").is_none() {
        // One host: UCX's loopback, as the tests run it (before any thread starts).
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    let path = crate::load::model_path(a.model.clone())?;
    let engine = |path: &std::path::Path| -> Result<Engine> {
        let (weights, _) = engine::weights::Weights::from_gguf(path)?;
        let model = Model::new(weights, a.threads)?;
        let cfg = EngineConfig { kv_blocks: KV_BLOCKS, prefix_cache: false, ..EngineConfig::default() };
        Ok(Engine::new(model, cfg, Vec::new())?)
    };
    let (mut prefill, mut decode) = (engine(&path)?, engine(&path)?);
    let layout = *prefill.pool().layout();
    let vocab = prefill.model().config().vocab as u32;
    let context = prefill.model().config().context;
    if let Some(n) = a.prompt_tokens.iter().find(|n| **n >= context || n.div_ceil(layout.block_size) > KV_BLOCKS) {
        bail!("a {n}-token prompt does not fit the model's context ({context}) or {KV_BLOCKS} KV blocks");
    }
    println!("cpu: {}", crate::bench::cpu_summary());
    // B's pool where the server reads payloads into, as a decode worker's (`tcp_direct`);
    // A's where the sender writes frames from, as a prefill worker's (`tcp_pinned`).
    let tcp = kind == TransportKind::Tcp;
    let direct = (tcp && a.tcp_direct).then(|| mapped(&mut decode)).transpose()?;
    let pinned = (tcp && a.tcp_pinned).then(|| mapped(&mut prefill)).transpose()?;
    let how = match (kind, &direct, &pinned) {
        (TransportKind::Tcp, Some(_), Some(_)) => "tcp, sent from the pool, read straight into the pool",
        (TransportKind::Tcp, Some(_), None) => "tcp, gathered, read straight into the pool",
        (TransportKind::Tcp, None, Some(_)) => "tcp, sent from the pool, read into buffers",
        (TransportKind::Tcp, None, None) => "tcp, gathered, read into buffers",
        (TransportKind::Quic, ..) => "quic",
        (TransportKind::Local, ..) => "local (shared memory)",
        (TransportKind::Ucx, ..) => "ucx (landing region)",
    };
    println!(
        "hand-off benchmark: {} ({} thread(s) per engine), {how}, {} reps per length",
        path.display(),
        a.threads,
        a.reps
    );
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let mut bench = rt.block_on(Bench::start(prefill, decode, layout, kind, direct, pinned))?;
    let baseline = if kind == TransportKind::Tcp { "raw TCP socket" } else { "transport alone" };
    println!("baseline (raw): {baseline}");
    println!(
        "{:>7} {:>8} {:>20} {:>20} {:>22} {:>10} {:>8} {:>12} {:>10}",
        "tokens",
        "KV MiB",
        "raw ms (min-max)",
        "transport alone ms",
        "hand-off ms (min-max)",
        "vs raw",
        "target",
        "A's tail ms",
        "decode ms"
    );
    for &n in &a.prompt_tokens {
        let bytes = n.div_ceil(layout.block_size) * layout.n_layers * 2 * layout.side_bytes();
        let [mut socket, mut alone, mut handoff, mut tail, mut step]: [Vec<Duration>; 5] = Default::default();
        for rep in 0..a.reps {
            let prompt = tokens(n, rep as u64, vocab);
            if kind == TransportKind::Tcp {
                socket.push(rt.block_on(raw_tcp(bytes))?);
            }
            alone.push(rt.block_on(bench.transport_alone(n))?);
            let h = rt.block_on(bench.handoff(prompt, 1000 * n as u64 + rep as u64))?;
            handoff.push(h.handoff);
            tail.push(h.tail);
            step.push(h.first_step);
        }
        let alone = spread(&mut alone);
        let r = if socket.is_empty() { alone } else { spread(&mut socket) };
        let (h, t, s) = (spread(&mut handoff), spread(&mut tail), spread(&mut step));
        let target = 1.3 * r.1 + 1.0;
        let verdict = if h.1 <= target { "met" } else { "missed" };
        println!(
            "{n:>7} {:>8.1} {:>6.2} ({:>5.2}-{:>5.2}) {:>6.2} ({:>5.2}-{:>5.2}) {:>8.2} ({:>5.2}-{:>5.2}) {:>9.2}x {:>8} {:>12.1} {:>10.1}",
            bytes as f64 / (1 << 20) as f64,
            r.1,
            r.0,
            r.2,
            alone.1,
            alone.0,
            alone.2,
            h.1,
            h.0,
            h.2,
            h.1 / r.1,
            verdict,
            t.1,
            s.1
        );
    }
    println!("target: hand-off median <= 1.3 x raw median + 1 ms (held to it at 1,024 tokens)");
    rt.block_on(bench.stop());
    Ok(())
}

/// (min, median, max) in milliseconds.
fn spread(v: &mut [Duration]) -> (f64, f64, f64) {
    v.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    (ms(v[0]), ms(v[v.len() / 2]), ms(v[v.len() - 1]))
}

/// Seeded pseudo-random prompt tokens.
fn tokens(n: usize, seed: u64, vocab: u32) -> Vec<u32> {
    let mut rng = types::rng::XorShift64::new(0x5DEE_CE66_D1CE_4E5B ^ seed.wrapping_mul(0x2545_F491_4F6C_DD1D));
    (0..n).map(|_| rng.below(u64::from(vocab)) as u32).collect()
}

/// `bytes` over a fresh loopback TCP connection into a buffer already
/// touched: first write to last read.
async fn raw_tcp(bytes: usize) -> Result<Duration> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let src = vec![0x5au8; bytes];
    // Touched before the clock, as the pools are: page faults on fresh memory are no transfer's cost.
    let mut dst = vec![1u8; bytes];
    let reader = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await?;
        s.read_exact(&mut dst).await?;
        Ok::<_, std::io::Error>(Instant::now())
    });
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.set_nodelay(true)?;
    let start = Instant::now();
    for piece in src.chunks(PIECE) {
        s.write_all(piece).await?;
    }
    let end = reader.await??;
    Ok(end - start)
}

/// What the decode engine's thread is told.
enum ToDecode {
    /// Reserve blocks for a prompt of this many tokens and register them.
    Reserve(usize, mpsc::Sender<Result<Reservation, String>>),
    /// An accepted frame, to write into the pool (from the server's sink).
    Write(WriteInstruction, OwnedPayload),
    /// A transfer with no sequence behind it is done: take its blocks and free them.
    Free(Reservation, mpsc::Sender<Result<(), String>>),
    /// The prefill's first token; then the `Ack` arrived: join and step.
    Join {
        req: Request,
        r: Reservation,
        first: SampledToken,
        done: mpsc::Sender<Result<Joined, String>>,
    },
    Stop,
}

struct Joined {
    /// When B held the sequence with its KV.
    at: Instant,
    /// B's first decode step.
    step: Duration,
}

/// The server's sink: each accepted frame to the decode thread, in order.
#[derive(Clone)]
struct ToThread(mpsc::Sender<ToDecode>);

impl BlockSink for ToThread {
    fn write_layer(&mut self, layer: usize, blocks: &[BlockId], k: &[u8], v: &[u8]) -> Result<(), String> {
        let w = WriteInstruction {
            reservation: Reservation { id: kvtransfer::ReservationId(0), generation: 0 },
            layer,
            blocks: blocks.to_vec(),
        };
        let payload: OwnedPayload = Box::new([k, v].concat());
        self.write_layer_owned(w, payload)
    }

    fn write_layer_owned(&mut self, w: WriteInstruction, payload: OwnedPayload) -> Result<(), String> {
        self.0.send(ToDecode::Write(w, payload)).map_err(|_| "the decode thread is gone".to_owned())
    }
}

struct Figures {
    /// Prefill done to B joined.
    handoff: Duration,
    /// A's last KV write to its prefill done.
    tail: Duration,
    first_step: Duration,
}

/// The decode side's KV server, of the transport under test, and how a sender
/// trusts it (QUIC: its self-signed certificate, pinned).
struct Server {
    server: KvServer,
    quic_pin: Option<PeerTrust>,
}

impl Server {
    async fn bind(
        kind: TransportKind,
        receiver: Arc<Mutex<Receiver>>,
        sink: ToThread,
        direct: Option<DirectPool>,
    ) -> Result<Self> {
        let mut quic_pin = None;
        let (addr, config) = match kind {
            TransportKind::Tcp => {
                ("127.0.0.1:0".to_owned(), ServerConfig::Tcp(TcpServerConfig { direct, ..TcpServerConfig::default() }))
            }
            TransportKind::Quic => {
                let id = TlsIdentity::self_signed(&["tandem-kv"]).map_err(|e| anyhow!("a certificate: {e}"))?;
                quic_pin = Some(PeerTrust::Pinned(id.fingerprint()));
                ("127.0.0.1:0".to_owned(), ServerConfig::Quic(QuicServerConfig::new(id)))
            }
            TransportKind::Local => {
                (format!("@tandem-handoff-{}", std::process::id()), ServerConfig::Local(LocalServerConfig::default()))
            }
            TransportKind::Ucx => (String::new(), ServerConfig::Ucx(UcxServerConfig::default())),
        };
        Ok(Self { server: KvServer::bind(&addr, receiver, sink, config).await?, quic_pin })
    }

    async fn connect(&self, p: &Peer, l: KvLayout) -> Result<KvSender> {
        let config = match self.server.kind() {
            TransportKind::Tcp => SenderConfig::Tcp(TcpSenderConfig::default()),
            TransportKind::Quic => {
                SenderConfig::Quic(QuicSenderConfig::new(self.quic_pin.clone().context("a quic server's pin")?))
            }
            TransportKind::Local => SenderConfig::Local(LocalSenderConfig::default()),
            TransportKind::Ucx => SenderConfig::Ucx(UcxSenderConfig::default()),
        };
        Ok(KvSender::connect(&self.server.local_addr(), p, l, config).await?)
    }

    fn shutdown(self) {
        self.server.shutdown();
    }
}

struct Bench {
    prefill: Arc<Mutex<Engine>>,
    layout: KvLayout,
    decode: mpsc::Sender<ToDecode>,
    decode_thread: Option<thread::JoinHandle<()>>,
    server: Option<Server>,
    peer: Peer,
    buffers: Buffers,
    /// A's pool in mapped memory: tcp layers go out straight from it.
    pinned: Option<DirectPool>,
}

impl Bench {
    async fn start(
        prefill: Engine,
        decode: Engine,
        layout: KvLayout,
        kind: TransportKind,
        direct: Option<DirectPool>,
        pinned: Option<DirectPool>,
    ) -> Result<Self> {
        let peer = Peer {
            version_group: VersionGroup::new("bench").map_err(|e| anyhow!("{e}"))?,
            fingerprint: LayoutFingerprint::new(&layout, &[0; 32], &[0; 32]),
        };
        let receiver = Arc::new(Mutex::new(
            Receiver::new(peer.clone(), ReceiverConfig::new(layout)).map_err(|e| anyhow!("receiver: {e}"))?,
        ));
        let (tx, rx) = mpsc::channel();
        let rx_for_thread = receiver.clone();
        let decode_thread = thread::spawn(move || decode_loop(decode, rx_for_thread, rx));
        let server =
            Server::bind(kind, receiver, ToThread(tx.clone()), direct).await.context("binding the KV server")?;
        Ok(Self {
            prefill: Arc::new(Mutex::new(prefill)),
            layout,
            decode: tx,
            decode_thread: Some(decode_thread),
            server: Some(server),
            peer,
            buffers: Buffers::new(64 << 20),
            pinned,
        })
    }

    async fn stop(mut self) {
        if let Some(s) = self.server.take() {
            s.shutdown();
        }
        let _ = self.decode.send(ToDecode::Stop);
        if let Some(t) = self.decode_thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
    }

    /// Blocks reserved on B for a prompt of `n` tokens.
    async fn reserve(&self, n: usize) -> Result<Reservation> {
        let (reply, reserved) = mpsc::channel();
        self.decode.send(ToDecode::Reserve(n, reply)).map_err(|_| anyhow!("decode thread gone"))?;
        tokio::task::spawn_blocking(move || reserved.recv()).await??.map_err(|e| anyhow!(e))
    }

    async fn connect(&self) -> Result<KvSender> {
        let server = self.server.as_ref().ok_or_else(|| anyhow!("the server is stopped"))?;
        server.connect(&self.peer, self.layout).await.context("connecting")
    }

    /// The KV of an `n`-token prompt over the transport alone: filled
    /// layers sent into blocks reserved on B, first frame to `Ack`; then
    /// the blocks are freed.
    async fn transport_alone(&mut self, n: usize) -> Result<Duration> {
        let r = self.reserve(n).await?;
        let mut tx = self.connect().await?;
        let side = n.div_ceil(self.layout.block_size) * self.layout.side_bytes();
        let (k, v) = (vec![0x5au8; side], vec![0xa5u8; side]);
        let start = Instant::now();
        for layer in 0..self.layout.n_layers {
            tx.send_blocks(r, layer, 0, &k, &v).await.context("sending a layer")?;
        }
        tx.complete(r).await.context("Complete")?;
        let took = start.elapsed();
        let (done, freed) = mpsc::channel();
        self.decode.send(ToDecode::Free(r, done)).map_err(|_| anyhow!("decode thread gone"))?;
        tokio::task::spawn_blocking(move || freed.recv()).await??.map_err(|e| anyhow!(e))?;
        Ok(took)
    }

    /// One prompt handed from A to B; see the module doc.
    async fn handoff(&mut self, prompt: Vec<u32>, id: u64) -> Result<Figures> {
        let r = self.reserve(prompt.len()).await?;
        let mut tx = self.connect().await?;

        // A's streaming sink, as the prefill worker's: each layer checksummed where it lies
        // (tcp from a mapped pool) or gathered into recycled buffers; the time of each call noted.
        let (layers_tx, mut layers) = tokio::sync::mpsc::unbounded_channel::<Streamed>();
        let last_layer = Arc::new(Mutex::new(None::<Instant>));
        let (buffers, last, layout) = (self.buffers.clone(), last_layer.clone(), self.layout);
        let pin = self.pinned.as_ref().and(tx.pinned_frames());
        // As the worker: only the prompt's last step goes from the pool (a preempted
        // prefill would give an earlier step's blocks back).
        let prompt_blocks = prompt.len().div_ceil(layout.block_size);
        let sink: engine::batch::LayerSink = Box::new(move |view: LayerView<'_>| {
            let last_step = view.first_block + view.blocks.len() == prompt_blocks;
            let pinned = pin.filter(|_| last_step).and_then(|max_frame| {
                let (k, v) = view.pool.layer_bytes(view.layer).ok()?;
                PinnedLayer::new(&layout, view.layer, view.first_block, view.blocks, k, v, max_frame).ok()
            });
            if let Some(p) = pinned {
                let _ = layers_tx.send(Streamed::Pinned(p));
            } else {
                let (mut k, mut v) = (buffers.take(), buffers.take());
                if view.gather_into(&mut k, &mut v).is_ok() {
                    let _ = layers_tx.send(Streamed::Gathered(view.layer, view.first_block, k, v));
                }
            }
            *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
        });
        let params = SamplingParams { max_tokens: 2, ignore_eos: true, ..SamplingParams::default() };
        let req = Request { id, prompt, params, salt: 0, priority: Default::default(), generated: Vec::new() };
        let prefill = self.prefill.clone();
        let req_a = req.clone();
        let computing = tokio::task::spawn_blocking(move || -> Result<(SampledToken, Instant), String> {
            let mut e = prefill.lock().unwrap_or_else(|e| e.into_inner());
            e.add_prefill_streaming(req_a, sink).map_err(|e| e.to_string())?;
            let first = loop {
                if let Some(ev) = e.step().map_err(|e| e.to_string())?.into_iter().next() {
                    break ev.token;
                }
            };
            let done = Instant::now();
            e.release_held(id);
            Ok((first, done))
        });
        while let Some(layer) = layers.recv().await {
            match (layer, &self.pinned) {
                (Streamed::Pinned(p), Some(pool)) => tx.send_pinned(r, &p, pool).await,
                (Streamed::Gathered(layer, first_block, k, v), _) => {
                    tx.send_blocks(r, layer, first_block, &k, &v).await
                }
                (Streamed::Pinned(_), None) => bail!("a pinned layer without A's mapped pool"),
            }
            .context("sending a layer")?;
        }
        // As the prefill worker: Complete once the prefill is done.
        let (first, prefilled) = computing.await?.map_err(|e| anyhow!("prefill: {e}"))?;
        tx.complete(r).await.context("Complete")?;
        let (done, joined) = mpsc::channel();
        self.decode.send(ToDecode::Join { req, r, first, done }).map_err(|_| anyhow!("decode thread gone"))?;
        let joined = tokio::task::spawn_blocking(move || joined.recv()).await??.map_err(|e| anyhow!(e))?;
        let last = last_layer.lock().unwrap_or_else(|e| e.into_inner()).ok_or_else(|| anyhow!("no layer streamed"))?;
        Ok(Figures {
            handoff: joined.at.saturating_duration_since(prefilled),
            tail: prefilled.saturating_duration_since(last),
            first_step: joined.step,
        })
    }
}

/// Moves `e`'s (still empty) pool into memory kvtransfer maps; returns its view.
fn mapped(e: &mut Engine) -> Result<DirectPool> {
    let memory = PoolMemory::new(*e.pool().layout(), e.pool().num_blocks())?;
    let view = memory.direct();
    e.pool_mut().adopt(memory.into_shared())?;
    Ok(view)
}

/// One layer's run of blocks from A's sink to the sender.
enum Streamed {
    /// Checksummed in A's mapped pool, sent from there.
    Pinned(PinnedLayer),
    /// Gathered: layer, first block, K, V.
    Gathered(usize, usize, Buffer, Buffer),
}

fn lock(r: &Mutex<Receiver>) -> std::sync::MutexGuard<'_, Receiver> {
    r.lock().unwrap_or_else(|e| e.into_inner())
}

/// Engine B's thread: reserves, writes accepted frames into the pool in
/// arrival order, and joins a sequence once told its `Ack` arrived (every
/// frame it acknowledged was posted here before).
fn decode_loop(mut e: Engine, receiver: Arc<Mutex<Receiver>>, rx: mpsc::Receiver<ToDecode>) {
    while let Ok(m) = rx.recv() {
        match m {
            ToDecode::Reserve(n, reply) => {
                let got = e.reserve_blocks(e.blocks_for(n)).map_err(|e| e.to_string()).and_then(|blocks| {
                    lock(&receiver)
                        .reserve(blocks, Duration::from_secs(60), tokio::time::Instant::now())
                        .map_err(|e| e.to_string())
                });
                let _ = reply.send(got);
            }
            ToDecode::Write(w, payload) => {
                let (k, v) = w.split_payload((*payload).as_ref());
                if let Err(err) = e.pool_mut().scatter_layer(w.layer, &w.blocks, k, v) {
                    eprintln!("writing received KV failed: {err}");
                }
            }
            ToDecode::Free(r, done) => {
                let freed = lock(&receiver)
                    .take_ready(r)
                    .map_err(|e| e.to_string())
                    .and_then(|blocks| e.release_reserved(&blocks).map_err(|e| e.to_string()));
                let _ = done.send(freed);
            }
            ToDecode::Join { req, r, first, done } => {
                let id = req.id;
                let joined = lock(&receiver)
                    .take_ready(r)
                    .map_err(|e| e.to_string())
                    .and_then(|blocks| e.add_prefilled(req, blocks, &first).map_err(|e| e.to_string()));
                let at = Instant::now();
                let result = joined.and_then(|_| {
                    let t = Instant::now();
                    let events = e.step().map_err(|e| e.to_string())?;
                    let step = t.elapsed();
                    if !events.iter().any(|ev| ev.id == id) {
                        return Err("the joined sequence produced no token".to_owned());
                    }
                    e.abort(id);
                    Ok(Joined { at, step })
                });
                let _ = done.send(result);
            }
            ToDecode::Stop => return,
        }
    }
}
