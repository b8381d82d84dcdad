//! Copying KV bytes and checksumming them in the same pass.
//!
//! Every transport's contract is a CRC-32C of exactly the bytes it moved,
//! taken by the sender and checked by the receiver over its own copy. Done
//! as a copy and then a checksum, that is two passes over the data; here the
//! checksum is folded into the copy: each 8-byte word is loaded once,
//! stored, and fed to the CRC instruction — or, on CPUs with AVX-512 and
//! VPCLMULQDQ, each 64-byte vector loaded once, stored, and folded into the
//! checksum by carry-less multiplication (`vpclmul.rs`, at the speed of a
//! plain copy). On a host whose copies are
//! bound by memory the checksum then costs next to nothing (the KV transfer
//! benches measure it; `cargo bench -p kvtransfer --features pool --bench ucx`
//! prints it as a floor).
//!
//! One of the few places allowed `unsafe` in this crate (beside the shared
//! memory mappings and the UCX transport's mapped stores): the copy loops
//! work on raw pointers, because over two slices the compiler knows they
//! cannot overlap and splits the loop back into a `memcpy` and a second
//! pass for the CRC, and memory a peer writes must never be referenced.

#![allow(unsafe_code)]

#[cfg(target_arch = "x86_64")]
mod vpclmul;

/// Bytes each of the three checksum streams of [`copy_crc`] covers per
/// round: 3 x 16 KiB beat 3 x 4 KiB and 3 x 1 KiB (fewer stream merges) in
/// a 256 MiB copy-and-checksum microbenchmark here.
pub(crate) const STREAM: usize = 16 << 10;

/// Multiplication by x^(8n) modulo the CRC-32C polynomial, on raw (not
/// inverted) CRC registers: appending `n` bytes to a message shifts its
/// register by this, then XORs in the register of those bytes alone, so
/// three streams of `n` bytes checksummed side by side merge into one.
/// Linear, so a table per byte of the register.
#[derive(Debug)]
pub(crate) struct Shift {
    n: usize,
    table: Box<[[u32; 256]; 4]>,
}

impl Shift {
    /// The operator for `n` bytes (built from `crc32c_combine`, which
    /// applies it to its first argument).
    pub(crate) fn new(n: usize) -> Self {
        let basis: Vec<u32> = (0..32).map(|i| crc32c::crc32c_combine(1 << i, 0, n)).collect();
        let mut table = Box::new([[0u32; 256]; 4]);
        for (k, row) in table.iter_mut().enumerate() {
            for (b, v) in row.iter_mut().enumerate() {
                *v = (0..8).filter(|bit| b >> bit & 1 == 1).fold(0, |acc, bit| acc ^ basis[k * 8 + bit]);
            }
        }
        Self { n, table }
    }

    /// The byte count it shifts by.
    pub(crate) fn n(&self) -> usize {
        self.n
    }

    fn apply(&self, x: u32) -> u32 {
        let t = &self.table;
        t[0][(x & 0xff) as usize]
            ^ t[1][(x >> 8 & 0xff) as usize]
            ^ t[2][(x >> 16 & 0xff) as usize]
            ^ t[3][(x >> 24) as usize]
    }
}

fn stream_shift() -> &'static Shift {
    static SHIFT: std::sync::OnceLock<Shift> = std::sync::OnceLock::new();
    SHIFT.get_or_init(|| Shift::new(STREAM))
}

/// Whether the fused loop can run here.
fn fused() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("sse4.2");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Copies `src` to the front of `dst` and returns `crc32c_append(crc, src)`,
/// computed in the same pass (see the crate-private `copy_crc`).
///
/// # Panics
/// If `dst` is shorter than `src`.
pub fn copy_crc32c(dst: &mut [u8], src: &[u8], crc: u32) -> u32 {
    let dst = &mut dst[..src.len()];
    // SAFETY: both ranges are valid for `src.len()` bytes, and a `&mut`
    // cannot overlap a `&`.
    unsafe { copy_crc(src.as_ptr(), dst.as_mut_ptr(), src.len(), crc) }
}

/// `crc32c::crc32c_append(crc, bytes)`, at the speed of the memory: whole
/// 256-byte rounds by carry-less multiplication (the crate-private
/// `vpclmul::fold`) where the CPU has it, the rest, and everything
/// elsewhere, by the `crc32c` crate (the CRC instruction). The checksum
/// every stream transport takes of a frame's payload, on both ends; the
/// TCP bench prints both speeds (`cargo bench -p kvtransfer --features
/// pool --bench tcp`).
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    // SAFETY: a slice is valid for reads of its length; no destination.
    #[cfg(target_arch = "x86_64")]
    let (done, crc) = unsafe { wide(bytes.as_ptr(), std::ptr::null_mut(), bytes.len(), crc, false) };
    #[cfg(not(target_arch = "x86_64"))]
    let (done, crc) = (0, crc);
    crc32c::crc32c_append(crc, &bytes[done..])
}

/// Appends `len` bytes read from `src` to `out` and returns
/// `crc32c_append(crc, <the bytes appended>)`, in one pass ([`copy_crc`]):
/// for copying out of memory a peer can write, whose bytes are read once.
///
/// # Safety
/// `src` is valid for reads of `len` bytes for the whole call and does not
/// overlap `out`'s allocation (memory another process writes is fine: it is
/// only read through raw pointers, never a reference).
pub(crate) unsafe fn append_crc(src: *const u8, len: usize, out: &mut Vec<u8>, crc: u32) -> u32 {
    out.reserve(len);
    let at = out.len();
    // SAFETY: `reserve` made room for `len` bytes past `at`, which `copy_crc`
    // initialises before `set_len` makes them part of `out`; the source is the
    // caller's contract, and it cannot overlap `out`.
    unsafe {
        let crc = copy_crc(src, out.as_mut_ptr().add(at), len, crc);
        out.set_len(at + len);
        crc
    }
}

/// Returns `crc32c_append(crc, <the len bytes at src>)`, reading them only
/// through raw pointers: for checksumming memory a peer can write (a pool
/// block a sender stored into) in place, with no reference formed. Whole
/// 256-byte rounds by [`vpclmul::fold`] where the CPU has it, with no copy;
/// the rest (everything elsewhere) copied through a small buffer and
/// checksummed there.
///
/// # Safety
/// `src` is valid for reads of `len` bytes for the whole call.
pub(crate) unsafe fn crc_raw(src: *const u8, len: usize, crc: u32) -> u32 {
    // SAFETY: the caller's contract; no destination.
    #[cfg(target_arch = "x86_64")]
    let (mut done, mut crc) = unsafe { wide(src, std::ptr::null_mut(), len, crc, false) };
    #[cfg(not(target_arch = "x86_64"))]
    let (mut done, mut crc) = (0, crc);
    let mut buf = [0u8; 4096];
    while done < len {
        let n = buf.len().min(len - done);
        // SAFETY: the caller's contract; `buf` is this frame's own.
        unsafe { std::ptr::copy_nonoverlapping(src.add(done), buf.as_mut_ptr(), n) };
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        done += n;
    }
    crc
}

/// Copies the three `shift.n`-byte `srcs` one after another to the front
/// of `dst` and returns `crc32c_append(crc, <them>)`, in one pass (three
/// streams, as in [`copy_crc`]): for gathering blocks of `shift.n` bytes.
///
/// # Panics
/// If a source is not `shift.n` bytes or `dst` is shorter than all three.
pub(crate) fn copy_crc3(dst: &mut [u8], srcs: [&[u8]; 3], shift: &Shift, crc: u32) -> u32 {
    let n = shift.n;
    assert!(srcs.iter().all(|s| s.len() == n), "sources of {n} bytes");
    let dst = &mut dst[..3 * n];
    if n % 8 != 0 || !fused() {
        let crc = copy_crc32c(dst, srcs[0], crc);
        let crc = copy_crc32c(&mut dst[n..], srcs[1], crc);
        return copy_crc32c(&mut dst[2 * n..], srcs[2], crc);
    }
    // SAFETY: each source is valid for `n` bytes, `dst` for `3n`, a `&mut`
    // overlaps no `&`; `n` is a multiple of 8; SSE 4.2 is present (`fused`).
    #[cfg(target_arch = "x86_64")]
    return unsafe { round_sse42(srcs.map(<[u8]>::as_ptr), dst.as_mut_ptr(), shift, crc) };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("fused() is false off x86_64")
}

/// The whole rounds of `len` bytes by [`vpclmul::fold`] where the CPU has
/// it (copied to `dst` unless it is null): returns the bytes done and the
/// checksum so far; `(0, crc)` elsewhere.
///
/// # Safety
/// As [`vpclmul::fold`], for `len` bytes.
#[cfg(target_arch = "x86_64")]
unsafe fn wide(src: *const u8, dst: *mut u8, len: usize, crc: u32, streaming: bool) -> (usize, u32) {
    let n = len / vpclmul::ROUND * vpclmul::ROUND;
    if n == 0 || !vpclmul::available() {
        return (0, crc);
    }
    // SAFETY: the caller's contract, for the first `n <= len` bytes; checked above.
    (n, unsafe { vpclmul::fold(src, dst, n, crc, streaming) })
}

/// Copies `len` bytes from `src` to `dst` and returns
/// `crc32c_append(crc, <the bytes written>)`. Where AVX-512 and VPCLMULQDQ
/// are there, whole 256-byte rounds go through [`vpclmul::fold`]: each
/// 64-byte vector loaded once, stored, and folded into the checksum. Where
/// SSE 4.2 is there, the checksum is computed on each 8-byte word between
/// its load and its store: the copy's one pass over memory is the
/// checksum's too (three interleaved streams hide the CRC instruction's
/// latency). Elsewhere, and for the last `< 3 * STREAM` bytes, it copies
/// and then checksums `dst`.
/// Either way the checksum is of what was written, never a second read of
/// `src`, which a peer may be changing.
///
/// # Safety
/// `src` valid for reads and `dst` for writes of `len` bytes; the ranges do
/// not overlap; nothing else reads or writes `dst` meanwhile.
pub(crate) unsafe fn copy_crc(src: *const u8, dst: *mut u8, len: usize, crc: u32) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { copy_crc_with(src, dst, len, crc, false) }
}

/// [`copy_crc`] into memory another process reads next (a decode pool's
/// blocks): where the vector loop runs, with non-temporal stores into a
/// 64-byte aligned `dst`, which leave this core's caches to the source and
/// made the direct path's copy faster (the ucx bench, alternated runs on a
/// Zen 4 VM: 0.59-0.65x `ucx_perftest` best against 0.52-0.53x).
///
/// # Safety
/// As [`copy_crc`].
pub(crate) unsafe fn copy_crc_streaming(src: *const u8, dst: *mut u8, len: usize, crc: u32) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { copy_crc_with(src, dst, len, crc, true) }
}

/// [`copy_crc`], `streaming` as [`vpclmul::fold`] takes it.
///
/// # Safety
/// As [`copy_crc`].
unsafe fn copy_crc_with(src: *const u8, dst: *mut u8, len: usize, crc: u32, streaming: bool) -> u32 {
    // SAFETY: the caller's contract.
    #[cfg(target_arch = "x86_64")]
    let (mut done, mut crc) = unsafe { wide(src, dst, len, crc, streaming) };
    #[cfg(not(target_arch = "x86_64"))]
    let (mut done, mut crc) = (0, crc);
    #[cfg(target_arch = "x86_64")]
    if fused() {
        let shift = stream_shift();
        while len - done >= 3 * STREAM {
            let s = src.add(done);
            // SAFETY: the caller's contract, for these 3 * STREAM bytes.
            crc = unsafe { round_sse42([s, s.add(STREAM), s.add(2 * STREAM)], dst.add(done), shift, crc) };
            done += 3 * STREAM;
        }
    }
    // SAFETY: the caller's contract, for the rest; `dst[done..len]` is
    // initialised by the copy before the slice is formed.
    unsafe {
        std::ptr::copy_nonoverlapping(src.add(done), dst.add(done), len - done);
        crc32c::crc32c_append(crc, std::slice::from_raw_parts(dst.add(done), len - done))
    }
}

/// Copies `shift.n` bytes from each of `src` to `dst`, one after another,
/// and returns `crc32c_append(crc, <them>)`.
///
/// # Safety
/// As [`copy_crc`], for each source's `shift.n` bytes and `dst`'s
/// `3 * shift.n`; `shift.n` a multiple of 8; SSE 4.2 present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.2")]
unsafe fn round_sse42(src: [*const u8; 3], dst: *mut u8, shift: &Shift, crc: u32) -> u32 {
    use std::arch::x86_64::_mm_crc32_u64;
    let n = shift.n;
    let (mut c0, mut c1, mut c2) = (u64::from(!crc), 0u64, 0u64);
    let mut i = 0;
    while i < n {
        // Each word is loaded once: the value checksummed is the value stored.
        let w0 = src[0].add(i).cast::<u64>().read_unaligned();
        let w1 = src[1].add(i).cast::<u64>().read_unaligned();
        let w2 = src[2].add(i).cast::<u64>().read_unaligned();
        dst.add(i).cast::<u64>().write_unaligned(w0);
        dst.add(n + i).cast::<u64>().write_unaligned(w1);
        dst.add(2 * n + i).cast::<u64>().write_unaligned(w2);
        c0 = _mm_crc32_u64(c0, w0);
        c1 = _mm_crc32_u64(c1, w1);
        c2 = _mm_crc32_u64(c2, w2);
        i += 8;
    }
    // The instruction keeps the register in its low 32 bits.
    !(shift.apply(shift.apply(c0 as u32) ^ c1 as u32) ^ c2 as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_copy_checksums_exactly_what_it_copied() {
        let size = 7 * 3 * STREAM + 5000;
        let bytes: Vec<u8> = (0..size).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut dst = vec![0u8; size + 1];
        // Three separate blocks, gathered.
        let shift = Shift::new(4104);
        let blocks = [&bytes[9000..13104], &bytes[..4104], &bytes[50_001..54_105]];
        let crc = copy_crc3(&mut dst, blocks, &shift, 7);
        assert_eq!(crc, crc32c::crc32c_append(7, &blocks.concat()));
        assert_eq!(&dst[..3 * 4104], &blocks.concat()[..]);
        let odd = Shift::new(5);
        assert_eq!(copy_crc3(&mut dst, [b"abcde", b"fghij", b"klmno"], &odd, 0), crc32c::crc32c(b"abcdefghijklmno"));
        // Appended to a buffer with bytes in it already, as a copy out of a peer's memory.
        let mut out = b"head".to_vec();
        // SAFETY: `bytes` holds at least 3 * STREAM + 7 bytes past 5 and is not `out`.
        let crc = unsafe { append_crc(bytes[5..].as_ptr(), 3 * STREAM + 7, &mut out, 9) };
        assert_eq!(crc, crc32c::crc32c_append(9, &bytes[5..5 + 3 * STREAM + 7]));
        assert_eq!(&out[..4], b"head");
        assert_eq!(&out[4..], &bytes[5..5 + 3 * STREAM + 7]);
        // Every length around the vector rounds' edges (256 bytes), from odd
        // alignments, copied and in place.
        for len in (0..1100).chain([4096, 4097, 65_535, 65_536 + 255]) {
            let from = len % 7;
            let src = &bytes[from..from + len];
            let want = crc32c::crc32c_append(0x5eed, src);
            dst.fill(0);
            assert_eq!(copy_crc32c(&mut dst[3..], src, 0x5eed), want, "copy {from}+{len}");
            assert_eq!(&dst[3..3 + len], src, "copy {from}+{len}");
            // Streaming stores into an aligned destination, and into an unaligned one.
            for at in [dst.as_ptr().align_offset(64), 5] {
                dst.fill(0);
                // SAFETY: `dst` holds `at + len` bytes, and is not `src`.
                let crc = unsafe { copy_crc_streaming(src.as_ptr(), dst.as_mut_ptr().add(at), len, 0x5eed) };
                assert_eq!((crc, &dst[at..at + len]), (want, src), "streaming {from}+{len} at {at}");
            }
            // SAFETY: `src` is valid for `len` bytes.
            assert_eq!(unsafe { crc_raw(src.as_ptr(), len, 0x5eed) }, want, "in place {from}+{len}");
            assert_eq!(crc32c_append(0x5eed, src), want, "slice {from}+{len}");
        }
        // From any alignment, appending to any checksum, across the fused rounds' edges:
        // copied, and in place through raw pointers.
        let edges = [(3, 3 * STREAM + 5), (1, size - 1), (8, 2), (0, 3 * STREAM), (5, 6 * STREAM - 8)];
        for (from, len) in edges.into_iter().chain([(5, 6 * STREAM - 9), (0, 0)]) {
            let src = &bytes[from..from + len];
            let want = crc32c::crc32c_append(0xdead, src);
            assert_eq!(copy_crc32c(&mut dst[1..], src, 0xdead), want, "{from}+{len}");
            assert_eq!(&dst[1..1 + len], src);
            // SAFETY: `src` is valid for `len` bytes.
            assert_eq!(unsafe { crc_raw(src.as_ptr(), len, 0xdead) }, want, "in place {from}+{len}");
            assert_eq!(crc32c_append(0xdead, src), want, "slice {from}+{len}");
        }
    }
}
