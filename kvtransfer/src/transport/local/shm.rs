//! The shared-memory ring: a sealed memfd of `slots` slots, mapped
//! read-write by the sender and read-only by the receiver. The only
//! `unsafe` code of the local transport: writing into the sender's mapping,
//! copying out of the receiver's, and the copy loop both sides use, which
//! computes the CRC-32C on the words it moves ([`copy_crc`]).
//!
//! Slot `i` starts at `i * stride` and its payload at [`DATA_OFFSET`] past
//! that; `stride` is the payload size plus the offset, rounded up to 4 KiB.
//!
//! What makes the mappings sound to use:
//! - The sender seals the file (`F_SEAL_SHRINK | F_SEAL_GROW |
//!   F_SEAL_FUTURE_WRITE | F_SEAL_SEAL`) after mapping it and before
//!   sharing the descriptor. No one can shrink it, so neither side's
//!   mapping can ever fault with SIGBUS; and no one else can write to it
//!   (no new writable mapping, no `write(2)`), so the sender's `&mut [u8]`
//!   into a slot is only ever written by the sender.
//! - The receiver refuses any descriptor that is not such a file: it must
//!   be shared memory on tmpfs (not hugetlbfs, whose faults can fail with
//!   SIGBUS when huge pages run out), sealed against shrinking, and exactly
//!   as large as announced; only then is it mapped, read-only.
//! - The receiver never forms a Rust reference into its mapping: the bytes
//!   may change under it (the sender owns them). It copies a slot out with
//!   raw copies (a chunk at a time) into memory it owns and treats the
//!   copy as untrusted input: the checksum runs over the copy, each chunk
//!   right after it was written.

#![allow(unsafe_code)]

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

use super::wire::RingRefusal;

/// Slot alignment: a page, so slots never share one.
const SLOT_ALIGN: usize = 4096;

/// Where a slot's payload starts within the slot. Not 0 on purpose: copies
/// whose destination lies 1..=31 bytes past the source modulo 4 KiB run up
/// to 6x slower on the machines we measured (AMD Zen, `rep movsb`, in the
/// kernel's copies as in glibc's), and heap buffers of a few hundred KiB
/// sit 16 bytes past a page boundary. With payloads at 64, neither the
/// sender's copy (caller's buffer -> slot) nor the receiver's (slot ->
/// payload buffer) hits that window for such buffers.
pub(super) const DATA_OFFSET: usize = 64;

/// `(stride, file length)` of a ring, or `None` if it overflows.
pub(super) fn geometry(slots: usize, slot_bytes: usize) -> Option<(usize, usize)> {
    let stride = DATA_OFFSET.checked_add(slot_bytes)?.checked_next_multiple_of(SLOT_ALIGN)?;
    Some((stride, stride.checked_mul(slots)?))
}

/// The sender's ring: it created the memfd, maps it read-write and owns
/// every slot it has not handed to the receiver.
#[derive(Debug)]
pub(super) struct SenderRing {
    file: File,
    map: MmapRaw,
    slots: usize,
    slot_bytes: usize,
    stride: usize,
}

impl SenderRing {
    /// Creates, sizes, maps and seals a fresh ring.
    pub(super) fn create(slots: usize, slot_bytes: usize) -> io::Result<Self> {
        let bad = |why| io::Error::new(io::ErrorKind::InvalidInput, why);
        if slots == 0 || slot_bytes == 0 {
            return Err(bad("a ring needs at least one slot of at least one byte"));
        }
        let (stride, len) = geometry(slots, slot_bytes).ok_or_else(|| bad("ring size overflows"))?;
        let fd = rustix::fs::memfd_create("tandem-kv-ring", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)?;
        rustix::fs::ftruncate(&fd, len as u64)?;
        let file = File::from(fd);
        // Populated: the first transfer should not pay a page fault per 4 KiB.
        let map = MmapOptions::new().len(len).populate().map_raw(&file)?;
        // Our own writable mapping exists now; from here on no one can add another.
        let seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::FUTURE_WRITE | SealFlags::SEAL;
        rustix::fs::fcntl_add_seals(&file, seals)?;
        Ok(Self { file, map, slots, slot_bytes, stride })
    }

    /// The memfd, to pass to the receiver.
    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The payload area of `slot`, for the sender to fill. The caller must
    /// own the slot (not handed to the receiver, or credited back since).
    pub(super) fn slot_mut(&mut self, slot: usize) -> Option<&mut [u8]> {
        if slot >= self.slots {
            return None;
        }
        let at = slot * self.stride + DATA_OFFSET;
        debug_assert!(at + self.slot_bytes <= self.map.len());
        // SAFETY: `at + slot_bytes` lies within the mapping (`geometry`:
        // stride >= DATA_OFFSET + slot_bytes, slot < slots), which lives as
        // long as `self` and is readable and writable. The bytes are
        // initialised (a fresh memfd reads as zeros). `&mut self` makes
        // this the only reference into the ring in this process, and the
        // FUTURE_WRITE seal (added before the descriptor left this process)
        // means no other mapping can write to it; the receiver's concurrent
        // reads do not touch this process's memory model.
        Some(unsafe { std::slice::from_raw_parts_mut(self.map.as_mut_ptr().add(at), self.slot_bytes) })
    }
}

/// The receiver's view of a sender's ring: read-only, copied out of only.
#[derive(Debug)]
pub(super) struct ReceiverRing {
    map: MmapRaw,
    slots: usize,
    slot_bytes: usize,
    stride: usize,
}

/// `TMPFS_MAGIC`: memfds live on the kernel's internal tmpfs mount.
const TMPFS_MAGIC: u64 = 0x0102_1994;

impl ReceiverRing {
    /// Checks that `fd` is a ring of `slots` slots of `slot_bytes` that can
    /// be mapped without risk (see the module docs), and maps it read-only.
    /// The caller has checked the sizes against its limits.
    pub(super) fn map(fd: OwnedFd, slots: usize, slot_bytes: usize) -> Result<Self, RingRefusal> {
        if slots == 0 || slot_bytes == 0 {
            return Err(RingRefusal::Limits);
        }
        let (stride, len) = geometry(slots, slot_bytes).ok_or(RingRefusal::Limits)?;
        let fs = rustix::fs::fstatfs(&fd).map_err(|_| RingRefusal::NotMemfd)?;
        if fs.f_type as u64 != TMPFS_MAGIC {
            return Err(RingRefusal::NotMemfd);
        }
        // Fails (EINVAL) for files that do not support seals.
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|_| RingRefusal::NotMemfd)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(RingRefusal::NotSealed);
        }
        // Checked after the seal: from here the size cannot go down.
        let st = rustix::fs::fstat(&fd).map_err(|_| RingRefusal::NotMemfd)?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(RingRefusal::NotMemfd);
        }
        if u64::try_from(st.st_size).ok() != Some(len as u64) {
            return Err(RingRefusal::Size);
        }
        let file = File::from(fd);
        // The mapping keeps the file alive; the descriptor closes on return.
        let map = MmapOptions::new().len(len).populate().map_raw_read_only(&file).map_err(|_| RingRefusal::Map)?;
        Ok(Self { map, slots, slot_bytes, stride })
    }

    pub(super) fn slots(&self) -> usize {
        self.slots
    }

    pub(super) fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    /// Replaces `out`'s contents with the first `len` bytes of `slot` and
    /// returns the CRC-32C of what it wrote. `None` (and `out` untouched)
    /// if the slot or length is out of range.
    ///
    /// The checksum is computed in the copy's own pass ([`copy_crc`]) over
    /// the words as they are stored into `out`, so it covers exactly the
    /// bytes the caller goes on to use, whatever the sender does to the
    /// slot meanwhile.
    pub(super) fn copy_out(&self, slot: usize, len: usize, out: &mut Vec<u8>) -> Option<u32> {
        if slot >= self.slots || len > self.slot_bytes {
            return None;
        }
        let at = slot * self.stride + DATA_OFFSET;
        debug_assert!(at + len <= self.map.len());
        out.clear();
        out.reserve_exact(len);
        // SAFETY: the source range lies within the mapping (checked above;
        // see `geometry`), which lives as long as `self`, is readable, and
        // cannot lose pages under us: the file is sealed against shrinking
        // and lives on tmpfs (checked in `map`). The bytes may be changed
        // concurrently by the sender; we never form a reference to them and
        // read each once, into `out`, whose capacity is at least `len` after
        // `reserve_exact` and which cannot overlap a shared mapping. The
        // copy initialises `out[..len]`, so `set_len(len)` is sound.
        unsafe {
            let crc = copy_crc(self.map.as_ptr().add(at), out.as_mut_ptr(), len, 0);
            out.set_len(len);
            Some(crc)
        }
    }
}

/// Bytes each of the three checksum streams of [`copy_crc`] covers per
/// round: 3 x 16 KiB beat 3 x 4 KiB and 3 x 1 KiB (fewer stream merges) in
/// a 256 MiB copy-and-checksum microbenchmark here.
const STREAM: usize = 16 << 10;

/// Multiplication by x^(8n) modulo the CRC-32C polynomial, on raw (not
/// inverted) CRC registers: appending `n` bytes to a message shifts its
/// register by this, then XORs in the register of those bytes alone, so
/// three streams of `n` bytes checksummed side by side merge into one.
/// Linear, so a table per byte of the register.
#[derive(Debug)]
pub(super) struct Shift {
    n: usize,
    table: Box<[[u32; 256]; 4]>,
}

impl Shift {
    /// The operator for `n` bytes (built from `crc32c_combine`, which
    /// applies it to its first argument).
    pub(super) fn new(n: usize) -> Self {
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
    pub(super) fn n(&self) -> usize {
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
/// computed in the same pass (see [`copy_crc`]).
///
/// # Panics
/// If `dst` is shorter than `src`.
pub(super) fn copy_crc_slice(dst: &mut [u8], src: &[u8], crc: u32) -> u32 {
    let dst = &mut dst[..src.len()];
    // SAFETY: both ranges are valid for `src.len()` bytes, and a `&mut`
    // cannot overlap a `&`.
    unsafe { copy_crc(src.as_ptr(), dst.as_mut_ptr(), src.len(), crc) }
}

/// Copies the three `shift.n`-byte `srcs` one after another to the front
/// of `dst` and returns `crc32c_append(crc, <them>)`, in one pass (three
/// streams, as in [`copy_crc`]): for gathering blocks of `shift.n` bytes.
///
/// # Panics
/// If a source is not `shift.n` bytes or `dst` is shorter than all three.
pub(super) fn copy_crc3(dst: &mut [u8], srcs: [&[u8]; 3], shift: &Shift, crc: u32) -> u32 {
    let n = shift.n;
    assert!(srcs.iter().all(|s| s.len() == n), "sources of {n} bytes");
    let dst = &mut dst[..3 * n];
    if n % 8 != 0 || !fused() {
        let crc = copy_crc_slice(dst, srcs[0], crc);
        let crc = copy_crc_slice(&mut dst[n..], srcs[1], crc);
        return copy_crc_slice(&mut dst[2 * n..], srcs[2], crc);
    }
    // SAFETY: each source is valid for `n` bytes, `dst` for `3n`, a `&mut`
    // overlaps no `&`; `n` is a multiple of 8; SSE 4.2 is present (`fused`).
    #[cfg(target_arch = "x86_64")]
    return unsafe { round_sse42(srcs.map(<[u8]>::as_ptr), dst.as_mut_ptr(), shift, crc) };
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("fused() is false off x86_64")
}

/// Copies `len` bytes from `src` to `dst` and returns
/// `crc32c_append(crc, <the bytes written>)`. Where SSE 4.2 is there, the
/// checksum is computed on each 8-byte word between its load and its
/// store: the copy's one pass over memory is the checksum's too (three
/// interleaved streams hide the CRC instruction's latency). Elsewhere, and
/// for the last `< 3 * STREAM` bytes, it copies and then checksums `dst`.
/// Either way the checksum is of what was written, never a second read of
/// `src`, which a peer may be changing.
///
/// # Safety
/// `src` valid for reads and `dst` for writes of `len` bytes; the ranges do
/// not overlap; nothing else reads or writes `dst` meanwhile.
unsafe fn copy_crc(src: *const u8, dst: *mut u8, len: usize, crc: u32) -> u32 {
    let mut done = 0;
    let mut crc = crc;
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
    fn bytes_written_by_the_sender_are_read_by_the_receiver() {
        let mut tx = SenderRing::create(3, 5000).expect("ring");
        let fd = tx.fd().try_clone_to_owned().expect("dup");
        let rx = ReceiverRing::map(fd, 3, 5000).expect("map");
        tx.slot_mut(2).expect("slot")[..4].copy_from_slice(b"kv!!");
        let mut out = vec![9; 10];
        assert_eq!(rx.copy_out(2, 4, &mut out), Some(crc32c::crc32c(b"kv!!")));
        assert_eq!(out, b"kv!!");
        assert_eq!(rx.copy_out(3, 4, &mut out), None, "slot out of range");
        assert_eq!(rx.copy_out(0, 5001, &mut out), None, "longer than a slot");
        assert_eq!(out, b"kv!!", "untouched when refused");
        assert!(tx.slot_mut(3).is_none());
    }

    #[test]
    fn the_copy_checksums_exactly_what_it_copied() {
        let mut dst = vec![0u8; 7 * 3 * STREAM + 5000];
        let size = 7 * 3 * STREAM + 5000;
        let mut tx = SenderRing::create(2, size).expect("ring");
        let rx = ReceiverRing::map(tx.fd().try_clone_to_owned().expect("dup"), 2, size).expect("map");
        let bytes: Vec<u8> = (0..size).map(|i| (i * 7 + i / 251) as u8).collect();
        tx.slot_mut(1).expect("slot").copy_from_slice(&bytes);
        let mut out = Vec::new();
        for len in [size, 3 * STREAM, 3 * STREAM - 1, 3 * STREAM + 13, 6 * STREAM + 8, 1, 0] {
            assert_eq!(rx.copy_out(1, len, &mut out), Some(crc32c::crc32c(&bytes[..len])), "{len}");
            assert_eq!(out, bytes[..len]);
        }
        // Three separate blocks, gathered.
        let shift = Shift::new(4104);
        let blocks = [&bytes[9000..13104], &bytes[..4104], &bytes[50_001..54_105]];
        let crc = copy_crc3(&mut dst, blocks, &shift, 7);
        assert_eq!(crc, crc32c::crc32c_append(7, &blocks.concat()));
        assert_eq!(&dst[..3 * 4104], &blocks.concat()[..]);
        let odd = Shift::new(5);
        assert_eq!(copy_crc3(&mut dst, [b"abcde", b"fghij", b"klmno"], &odd, 0), crc32c::crc32c(b"abcdefghijklmno"));
        // From any alignment, appending to any checksum.
        for (from, len) in [(3, 3 * STREAM + 5), (1, size - 1), (8, 2)] {
            let src = &bytes[from..from + len];
            assert_eq!(copy_crc_slice(&mut dst[1..], src, 0xdead), crc32c::crc32c_append(0xdead, src));
            assert_eq!(&dst[1..1 + len], src);
        }
    }

    #[test]
    fn receiver_refuses_what_it_cannot_map_safely() {
        let tx = SenderRing::create(2, 4096).expect("ring");
        let dup = || tx.fd().try_clone_to_owned().expect("dup");
        assert_eq!(ReceiverRing::map(dup(), 3, 4096).err(), Some(RingRefusal::Size));
        assert_eq!(ReceiverRing::map(dup(), 2, 4000).err(), Some(RingRefusal::Size));
        // An unsealed memfd could be truncated under the mapping.
        let unsealed = rustix::fs::memfd_create("x", MemfdFlags::CLOEXEC).expect("memfd");
        rustix::fs::ftruncate(&unsealed, 8192).expect("size");
        assert_eq!(ReceiverRing::map(unsealed, 1, 4096).err(), Some(RingRefusal::NotSealed));
        // Not shared memory at all.
        let file = File::open("/proc/self/exe").map(OwnedFd::from).expect("open");
        assert_eq!(ReceiverRing::map(file, 1, 4096).err(), Some(RingRefusal::NotMemfd));
    }

    #[test]
    fn the_receiver_cannot_write_to_a_sealed_ring() {
        let tx = SenderRing::create(1, 4096).expect("ring");
        let file = File::from(tx.fd().try_clone_to_owned().expect("dup"));
        assert!(MmapOptions::new().len(8192).map_raw(&file).is_err(), "writable mapping refused");
        assert!(rustix::io::pwrite(&file, b"x", 64).is_err(), "write(2) refused");
        assert!(rustix::fs::ftruncate(&file, 0).is_err(), "shrinking refused");
    }
}
