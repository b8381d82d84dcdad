//! Half-precision helpers shared by the KV cache and weight formats.

use half::{bf16, f16};

#[inline]
pub fn f16_bits_to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

#[inline]
pub fn f32_to_f16_bits(v: f32) -> u16 {
    f16::from_f32(v).to_bits()
}

#[inline]
pub fn bf16_bits_to_f32(bits: u16) -> f32 {
    bf16::from_bits(bits).to_f32()
}

/// Reads a little-endian u16 at `i` (2-byte units) of a byte slice.
#[inline]
pub fn le_u16(bytes: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])
}
