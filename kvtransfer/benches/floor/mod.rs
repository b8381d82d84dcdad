//! What the KV integrity contract costs on this host before any transport
//! runs: the least work a pool-to-pool transfer can do when the sender
//! checksums what it sends and the receiver checksums what it keeps, done by
//! two threads that hand layers over through a channel they spin on, and
//! nothing else (no UCX, no sockets, no wake-ups). Measured beside the
//! transports in the same run, so a ratio against `ucx_perftest` can be read
//! as "how much of the gap is the transport, how much the work itself".
//!
//! Two shapes, on the same bytes as the transfers, layer by layer (a
//! layer's K then V, each one run of blocks, as the consecutive blocks of
//! the benches' reservations are in a pool):
//! - [`Shape::Landing`], the UCX transport as built: the sender gathers a
//!   layer into a buffer (the prefill engine does, on its own thread) and
//!   stores it into a landing region with its checksum taken in the same
//!   pass (on shared memory the sender writes the mapped region; a put is
//!   that copy); the receiver copies it out with its checksum in the same
//!   pass and scatters the copy into the pool. Four copies, the checksums
//!   inside two of them.
//! - [`Shape::Direct`]: one copy, pool to pool, with the sender's checksum
//!   taken in the same pass as the copy ([`kvtransfer::checksum::copy_crc32c`],
//!   the loop the local transport uses), the receiver checksumming what
//!   landed in its pool on the other thread.
//!   What a sender writing straight into the decode pool would cost: the
//!   least the contract allows.

use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::time::Duration;
use tokio::time::Instant;

use kvtransfer::checksum::copy_crc32c;

#[derive(Debug, Clone, Copy)]
pub enum Shape {
    Landing,
    Direct,
}

impl Shape {
    pub const ALL: [Shape; 2] = [Self::Landing, Self::Direct];

    pub fn label(self) -> &'static str {
        match self {
            Self::Landing => "floor, landing as built",
            Self::Direct => "floor, direct + fused CRC",
        }
    }
}

/// Source pool, destination pool and landing region of one transfer's bytes.
pub struct Floor {
    src: Vec<u8>,
    dst: Vec<u8>,
    landing: Vec<u8>,
    layers: usize,
    /// The checksum of every layer, to check each shape against.
    want: Vec<u32>,
}

impl Floor {
    /// `layers` layers of `2 x blocks x side` bytes each (`side`: one
    /// block's K or V in one layer).
    pub fn new(layers: usize, blocks: usize, side: usize) -> Self {
        let total = layers * 2 * blocks * side;
        let src: Vec<u8> = (0..total).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let want = src.chunks(total / layers).map(crc32c::crc32c).collect();
        Self { src, dst: vec![1; total], landing: vec![1; total], layers, want }
    }

    /// One transfer in `shape`, timed from the first byte read to the
    /// receiver's last checksum; errors if a checksum or the destination
    /// differs from the source.
    pub fn run(&mut self, shape: Shape) -> Result<Duration, String> {
        self.dst.fill(0);
        let layer = self.src.len() / self.layers;
        let (src, landing) = (&self.src, &mut self.landing);
        let dst_layers = self.dst.chunks_mut(layer);
        let start = Instant::now();
        let (sent, got) = std::thread::scope(|s| {
            let (tx, rx) = mpsc::channel::<&mut [u8]>();
            let mut sent = Vec::with_capacity(src.len() / layer);
            let receiver = match shape {
                Shape::Landing => {
                    let receiver = s.spawn(move || landing_receiver(rx, dst_layers));
                    let mut gathered = vec![0u8; layer];
                    for (from, to) in src.chunks(layer).zip(landing.chunks_mut(layer)) {
                        gathered.copy_from_slice(from);
                        let crc = copy_crc32c(to, &gathered, 0);
                        sent.push(crc);
                        let _ = tx.send(to);
                    }
                    receiver
                }
                Shape::Direct => {
                    let receiver = s.spawn(move || direct_receiver(rx));
                    for (from, to) in src.chunks(layer).zip(dst_layers) {
                        let crc = copy_crc32c(to, from, 0);
                        sent.push(crc);
                        let _ = tx.send(to);
                    }
                    receiver
                }
            };
            drop(tx);
            receiver.join().map(|got| (sent, got))
        })
        .map_err(|_| "a floor thread panicked".to_string())?;
        let elapsed = start.elapsed();
        if sent != self.want || got != self.want {
            return Err(format!("{}: checksums differ from the source's", shape.label()));
        }
        if self.dst != self.src {
            return Err(format!("{}: the destination differs from the source", shape.label()));
        }
        Ok(elapsed)
    }
}

/// The next layer, spinning rather than sleeping (a wake-up is not part of
/// the floor); `None` once the sender is done.
fn next<T>(rx: &Receiver<T>) -> Option<T> {
    loop {
        match rx.try_recv() {
            Ok(x) => return Some(x),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => std::hint::spin_loop(),
        }
    }
}

/// Copies each landed layer out with its checksum in the same pass and
/// scatters the copy into the destination pool's blocks.
fn landing_receiver<'a>(rx: Receiver<&'a mut [u8]>, mut dst: impl Iterator<Item = &'a mut [u8]>) -> Vec<u32> {
    let mut crcs = Vec::new();
    let mut copy = Vec::new();
    while let Some(landed) = next(&rx) {
        copy.resize(landed.len(), 0);
        crcs.push(copy_crc32c(&mut copy, landed, 0));
        let Some(to) = dst.next() else { break };
        to.copy_from_slice(&copy);
    }
    crcs
}

/// Checksums each layer where it landed, in the destination pool.
fn direct_receiver(rx: Receiver<&mut [u8]>) -> Vec<u32> {
    let mut crcs = Vec::new();
    while let Some(landed) = next(&rx) {
        crcs.push(crc32c::crc32c(landed));
    }
    crcs
}
