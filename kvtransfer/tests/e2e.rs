//! End to end in memory: KV written into one engine pool travels as encoded
//! frames through the receiver state machine into different block ids of a
//! second pool, and arrives bit-exact.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code: a failed expectation is the failure")]

mod common;

use std::time::Duration;
use tokio::time::Instant;

use engine::kv::KvPool;

use kvtransfer::{
    gathered_layer, split_layer, Complete, DecodeLimits, Decoded, Frame, Hello, LayoutFingerprint, Peer, Receiver,
    ReceiverConfig, ReleaseCause, Reservation, ReservationState, VersionGroup, PROTOCOL_VERSION,
};
use types::kv::{BlockId, KvDtype, KvLayout};

fn layout(dtype: KvDtype) -> KvLayout {
    KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 8, block_size: 4, dtype }
}

fn peer(l: &KvLayout) -> Peer {
    Peer {
        version_group: VersionGroup::new("smollm2-135m").expect("label"),
        fingerprint: LayoutFingerprint::new(l, &[0x11; 32], &[0x22; 32]),
    }
}

/// Prefill side: `n` blocks of known K/V values.
fn source(l: KvLayout, n: usize) -> (KvPool, Vec<BlockId>) {
    common::source(l, n, 16)
}

/// Sender side: the whole conversation after the handshake, as wire bytes.
/// Layers go last-first to show order does not matter.
fn sender_stream(l: &KvLayout, pool: &KvPool, table: &[BlockId], r: Reservation, max_frame: usize) -> Vec<u8> {
    let gathered = pool.gather(table).expect("gather");
    let mut wire = Vec::new();
    for layer in (0..l.n_layers).rev() {
        let kv = gathered_layer(l, &gathered, table.len(), layer).expect("layer slice");
        for frame in split_layer(l, r, layer, kv, max_frame).expect("split") {
            Frame::LayerData(frame).encode(&mut wire).expect("encode");
        }
    }
    let complete = Complete { reservation: r.id.0, generation: r.generation, n_layers: l.n_layers as u32 };
    Frame::Complete(complete).encode(&mut wire).expect("encode");
    wire
}

/// Decodes a byte stream delivered in uneven chunks, as a socket would.
fn decode_chunked(wire: &[u8]) -> Vec<Frame> {
    let limits = DecodeLimits::default();
    let (mut buf, mut frames, mut fed) = (Vec::new(), Vec::new(), 0);
    let mut chunk = 1;
    while fed < wire.len() || !buf.is_empty() {
        let end = (fed + chunk).min(wire.len());
        buf.extend_from_slice(&wire[fed..end]);
        fed = end;
        chunk = chunk % 97 + 13;
        loop {
            match Frame::decode(&buf, &limits).expect("valid stream") {
                Decoded::Frame { frame, consumed } => {
                    frames.push(frame);
                    buf.drain(..consumed);
                }
                Decoded::NeedMore { at_least } => {
                    assert!(fed < wire.len() || buf.is_empty(), "stream ended mid-frame, {at_least} bytes wanted");
                    break;
                }
            }
        }
    }
    frames
}

/// Writes one accepted payload into `layer` of `blocks` in `pool`. The
/// engine's scatter takes every layer at once, so read, patch, write back.
fn write_layer(pool: &mut KvPool, layer: usize, blocks: &[BlockId], payload: &[u8]) {
    let mut all = pool.gather(blocks).expect("gather B");
    let per_layer = payload.len();
    all[layer * per_layer..(layer + 1) * per_layer].copy_from_slice(payload);
    pool.scatter(blocks, &all).expect("scatter B");
}

fn handshake(rx: &mut Receiver, sender: &Peer) {
    let hello = Hello {
        version_group: sender.version_group.clone(),
        fingerprint: sender.fingerprint,
        protocol_version: PROTOCOL_VERSION,
    };
    let mut wire = Vec::new();
    Frame::Hello(hello).encode(&mut wire).expect("encode");
    let Ok(Decoded::Frame { frame: Frame::Hello(got), .. }) = Frame::decode(&wire, &DecodeLimits::default()) else {
        panic!("hello did not decode");
    };
    let ack = rx.on_hello(&got).expect("handshake accepted");
    wire.clear();
    Frame::HelloAck(ack).encode(&mut wire).expect("encode");
    assert!(matches!(
        Frame::decode(&wire, &DecodeLimits::default()),
        Ok(Decoded::Frame { frame: Frame::HelloAck(_), .. })
    ));
}

#[test]
fn kv_arrives_bit_exact_in_other_block_ids() {
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let l = layout(dtype);
        let (pool_a, table_a) = source(l, 5);
        let mut pool_b = KvPool::new(l, 16).expect("pool B");
        let _decoys = pool_b.allocate(7).expect("decoys");
        let mut rx = Receiver::new(peer(&l), ReceiverConfig::new(l)).expect("receiver");
        handshake(&mut rx, &peer(&l));

        let t0 = Instant::now();
        let table_b = pool_b.allocate(5).expect("alloc B");
        assert_ne!(table_a, table_b, "the test must move KV between different ids");
        let r = rx.reserve(table_b.clone(), Duration::from_secs(30), t0).expect("reserve");

        // Two blocks per frame: 3 frames per layer.
        let per_block = 2 * l.block_elems() * dtype.size();
        let max_frame = kvtransfer::frame::LAYER_DATA_OVERHEAD + 2 * per_block;
        let frames = decode_chunked(&sender_stream(&l, &pool_a, &table_a, r, max_frame));
        assert_eq!(frames.len(), 2 * 3 + 1);

        let mut ack = None;
        for (i, frame) in frames.into_iter().enumerate() {
            let now = t0 + Duration::from_millis(i as u64);
            match frame {
                Frame::LayerData(d) => {
                    assert!(rx.take_ready(r).is_err(), "blocks must not be readable mid-transfer");
                    let w = rx.on_layer(&d, now).expect("frame accepted");
                    assert_eq!(w.blocks, table_b[d.first_block as usize..(d.first_block + d.n_blocks) as usize]);
                    write_layer(&mut pool_b, w.layer, &w.blocks, &d.payload);
                }
                Frame::Complete(c) => ack = Some(rx.on_complete(&c, now).expect("complete")),
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(ack.map(|a| (a.reservation, a.generation)), Some((r.id.0, r.generation)));
        let blocks = rx.take_ready(r).expect("ready");
        assert_eq!(blocks, table_b);
        assert_eq!(pool_b.gather(&blocks).expect("gather B"), pool_a.gather(&table_a).expect("gather A"), "{dtype:?}");
        pool_b.release(&blocks).expect("engine frees after decode");
        assert_eq!(rx.held_blocks(), 0);
    }
}

#[test]
fn corruption_on_the_wire_fails_the_transfer_and_returns_the_blocks() {
    let l = layout(KvDtype::F16);
    let (pool_a, table_a) = source(l, 3);
    let mut pool_b = KvPool::new(l, 8).expect("pool B");
    let mut rx = Receiver::new(peer(&l), ReceiverConfig::new(l)).expect("receiver");
    let t0 = Instant::now();
    let table_b = pool_b.allocate(3).expect("alloc B");
    let r = rx.reserve(table_b.clone(), Duration::from_secs(30), t0).expect("reserve");
    let mut wire = sender_stream(&l, &pool_a, &table_a, r, 1 << 20);
    // One frame per layer; flip a payload bit in the second one.
    let first_len = kvtransfer::frame::LAYER_DATA_OVERHEAD + 3 * 2 * l.block_elems() * 2;
    wire[first_len + kvtransfer::frame::LAYER_DATA_OVERHEAD + 5] ^= 0x10;
    let frames = decode_chunked(&wire);
    let mut errors = Vec::new();
    for frame in frames {
        let res = match frame {
            Frame::LayerData(d) => {
                rx.on_layer(&d, t0).map(|w| write_layer(&mut pool_b, w.layer, &w.blocks, &d.payload))
            }
            Frame::Complete(c) => rx.on_complete(&c, t0).map(drop),
            other => panic!("unexpected {other:?}"),
        };
        if let Err(e) = res {
            errors.push(e.reason());
        }
    }
    assert_eq!(errors, ["checksum", "failed"], "the corrupt frame, then Complete for a failed reservation");
    assert_eq!(rx.state(r), Some(ReservationState::Failed));
    assert!(rx.take_ready(r).is_err());
    let released = rx.poll_released(t0);
    assert_eq!(released.len(), 1);
    assert_eq!((released[0].cause, &released[0].blocks), (ReleaseCause::Corrupt, &table_b));
    pool_b.release(&released[0].blocks).expect("release");
    assert_eq!(pool_b.stats().used, 0, "no block leaked");
}
