//! Direct reads: the decode pool in memory this crate maps, so that a TCP
//! server reads each accepted payload from the socket straight into the
//! reservation's pool blocks — one copy, kernel to pool, as raw TCP into a
//! buffer makes — instead of into a buffer the sink then copies from (the
//! receiver's side of the rules: `session/direct.rs`).
//!
//! [`PoolMemory`] is the pool's memory: the engine adopts it
//! ([`into_shared`](PoolMemory::into_shared), `KvPool::adopt`), the TCP
//! server gets a [`DirectPool`] over it
//! ([`TcpServerConfig::direct`](super::tcp::TcpServerConfig::direct)).
//! Blocks lie where `KvLayout::pool_offset` says, the one formula the
//! engine and every in-place writer share. The server writes a block only
//! between `Receiver::begin_direct` and `end_direct`/`abandon_direct`,
//! while the receiver holds it back from the engine; it writes and
//! checksums through raw pointers only (`readv` into them, CRC-32C over
//! them), never a Rust reference, as the UCX direct path does
//! (`types::memory::SharedMemory`'s contract).

#![allow(unsafe_code)]

use std::io;
use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use memmap2::{MmapMut, MmapOptions};
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::time::{sleep_until, Instant};
use types::kv::{BlockId, KvLayout};
use types::memory::SharedMemory;

use super::lock::lock;
use super::stream::{FrameReader, ReadError};
use crate::checksum;
use crate::session::{Receiver, Reservation};

/// Most payload bytes one `readv` takes: the checksum runs over each read's
/// bytes right after it, so a read should stay in L2 (as `stream.rs`'s
/// buffered reads).
const READ_CHUNK: usize = 256 << 10;

/// Most pieces one `readv` names (Linux allows 1,024).
const MAX_IOV: usize = 256;

/// Keeps a pool's mapping alive; its bytes are never reached through it.
struct Mapping(#[allow(dead_code, reason = "owned to keep the mapping; never read")] MmapMut);

/// Memory for a decode pool of `num_blocks` blocks of `layout`, mapped and
/// populated by this crate, for the engine to adopt and a TCP server to
/// read payloads into ([`direct`](Self::direct)).
pub struct PoolMemory {
    pool: DirectPool,
}

impl PoolMemory {
    /// Maps `layout.pool_bytes(num_blocks)` zeroed bytes, asks for huge pages
    /// and backs them with pages now, so no transfer pays page faults.
    ///
    /// Huge pages (`MADV_HUGEPAGE`, taken where the kernel's THP setting is
    /// `madvise` or `always`): a direct read's copy lands in many blocks spread
    /// over the whole pool, and with 4 KiB pages the kernel's copy into them
    /// missed the TLB at every page. Populated after the advice
    /// (`MADV_POPULATE_WRITE`; `MAP_POPULATE` would fault the small pages in
    /// first); where the kernel does not know that advice (before Linux 5.14)
    /// the pages are faulted in by touching them. Any other failure to back
    /// the pool (out of memory, a cgroup's limit) is this call's error, not
    /// an OOM kill later.
    pub fn new(layout: KvLayout, num_blocks: usize) -> io::Result<Self> {
        let len = layout
            .pool_bytes(num_blocks)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "KV pool size overflows"))?;
        // A zero-length mapping is refused by the kernel; one byte stands in.
        let mut map = MmapOptions::new().len(len.max(1)).map_anon()?;
        // Best effort: without huge pages the pool works the same, a little slower.
        let _ = map.advise(memmap2::Advice::HugePage);
        match map.advise(memmap2::Advice::PopulateWrite) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                // SAFETY: sysconf has no preconditions.
                let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096).max(1);
                for p in map.chunks_mut(page) {
                    p[0] = 0;
                }
            }
            Err(e) => return Err(io::Error::new(e.kind(), format!("backing a {len}-byte KV pool: {e}"))),
        }
        let addr = map.as_mut_ptr() as usize;
        let owner: Arc<dyn Send + Sync> = Arc::new(Mapping(map));
        Ok(Self { pool: DirectPool { addr, len, num_blocks, layout, owner } })
    }

    /// What a TCP server reads payloads into.
    pub fn direct(&self) -> DirectPool {
        self.pool.clone()
    }

    /// The memory as the engine's pool adopts it.
    pub fn into_shared(self) -> SharedMemory {
        let ptr = std::ptr::NonNull::new(self.pool.addr as *mut u8).unwrap_or(std::ptr::NonNull::dangling());
        // SAFETY: `addr..addr + len` is the mapping `owner` keeps alive,
        // zeroed at creation; no Rust reference into it exists (the mapping
        // is never dereferenced; the server writes it through raw pointers
        // only, and only blocks the receiver holds back from the engine).
        unsafe { SharedMemory::new(ptr, self.pool.len, Box::new(self.pool.owner)) }
    }
}

impl std::fmt::Debug for PoolMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolMemory").field("pool", &self.pool).finish()
    }
}

/// A decode pool a TCP server reads payloads straight into: where each
/// block's K and V of each layer lie ([`PoolMemory::direct`]). Keeps the
/// memory mapped while it lives.
#[derive(Clone)]
pub struct DirectPool {
    addr: usize,
    len: usize,
    num_blocks: usize,
    layout: KvLayout,
    owner: Arc<dyn Send + Sync>,
}

impl DirectPool {
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The pieces of memory a layer frame's payload fills, in payload
    /// order (K of each block, then V of each), adjacent blocks merged;
    /// `None` if a block is outside the pool (then nothing is written).
    pub(crate) fn pieces(&self, layer: usize, blocks: &[BlockId]) -> Option<Vec<(usize, usize)>> {
        let side = self.layout.side_bytes();
        if layer >= self.layout.n_layers {
            return None;
        }
        let mut out: Vec<(usize, usize)> = Vec::new();
        for v in [false, true] {
            for &b in blocks {
                let b = usize::try_from(b).ok().filter(|&b| b < self.num_blocks)?;
                let at = self.addr + self.layout.pool_offset(self.num_blocks, layer, v, b);
                debug_assert!(at + side <= self.addr + self.len);
                match out.last_mut() {
                    Some((start, len)) if *start + *len == at => *len += side,
                    _ => out.push((at, side)),
                }
            }
        }
        Some(out)
    }
}

impl std::fmt::Debug for DirectPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectPool")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("num_blocks", &self.num_blocks)
            .finish()
    }
}

/// The same memory.
impl PartialEq for DirectPool {
    fn eq(&self, other: &Self) -> bool {
        (self.addr, self.len, self.num_blocks) == (other.addr, other.len, other.num_blocks)
    }
}

impl Eq for DirectPool {}

/// A stream whose payloads can be read straight into raw memory: a TCP
/// socket (`readv`). Every other stream (a QUIC stream, an in-memory one)
/// reads into buffers.
pub(crate) trait DirectRead {
    fn socket(&self) -> Option<&TcpStream> {
        None
    }
}

impl DirectRead for tokio::net::tcp::ReadHalf<'_> {
    fn socket(&self) -> Option<&TcpStream> {
        Some(self.as_ref())
    }
}

impl DirectRead for quinn::RecvStream {}

impl<T> DirectRead for tokio::io::ReadHalf<T> {}

/// How a read straight into the pool ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum InPlace {
    /// All of it is in the blocks, with this CRC-32C of it as it lies there.
    Landed(u32),
    /// A block is outside the pool: nothing was read or written.
    Outside,
    /// The reservation stopped receiving (its lease passed, it was aborted
    /// or failed) before the payload was all there: the caller abandons
    /// the direct read, so the blocks go back now, and reads the last
    /// `left` bytes of the payload elsewhere, to be refused.
    Stopped { left: usize },
}

/// Reads the `len`-byte payload of a frame of `layer` for `blocks` of `r`
/// from `socket` (its front from what `reader` read ahead) straight into
/// the blocks of `pool`, computing the CRC-32C of the bytes as they lie
/// there read by read. The caller holds the blocks open for this
/// (`Receiver::begin_direct`) and has checked `len` against them.
///
/// A sender that stalls mid-payload must not keep the blocks past its
/// reservation's lease: while it waits for bytes it also wakes at the
/// lease's end, as `receiver` says it when the read starts (asked again
/// only then), and stops there if `r` no longer receives. A reservation
/// aborted or failed meanwhile is noticed when the payload ends (or at the
/// lease's end): its blocks stay quarantined until then and `end_direct`
/// refuses the frame.
#[allow(clippy::too_many_arguments, reason = "one read's whole context; a struct would only rename it")]
pub(crate) async fn read_into_pool(
    socket: &TcpStream,
    reader: &mut FrameReader,
    pool: &DirectPool,
    receiver: &Mutex<Receiver>,
    r: Reservation,
    layer: usize,
    blocks: &[BlockId],
    len: usize,
    idle: Duration,
) -> Result<InPlace, ReadError> {
    let Some(pieces) = pool.pieces(layer, blocks) else { return Ok(InPlace::Outside) };
    if pieces.iter().map(|p| p.1).sum::<usize>() != len {
        return Ok(InPlace::Outside);
    }
    let mut at = Cursor { pieces: &pieces, piece: 0, offset: 0 };
    let mut crc = 0;
    // What was read ahead with the header: copied in, checksummed there.
    let mut front = reader.take_buffered(len);
    while !front.is_empty() {
        let (dst, room) = at.here();
        let n = room.min(front.len());
        // SAFETY: `dst..dst + n` lies in a block the receiver holds open for
        // this read (in the pool's mapping, alive through `pool`); `front`
        // is this reader's own buffer, which cannot overlap it.
        crc = unsafe {
            std::ptr::copy_nonoverlapping(front.as_ptr(), dst, n);
            checksum::crc_raw(dst, n, crc)
        };
        front = &front[n..];
        at.advance(n);
    }
    // One timer for the whole payload, at the lease's end or the idle limit, whichever
    // comes first; it is re-armed only when it fires. A reservation that ends otherwise
    // meanwhile (aborted, failed) has its blocks quarantined by the receiver until this
    // read closes, and `end_direct` refuses the frame: asking the receiver before every
    // `readv` (a lock and a timer per read) bought nothing but cost a fifth of the CPU
    // a direct read adds over raw TCP.
    if at.remaining() == 0 {
        // All of it came with the header: nothing to wait for.
        return Ok(InPlace::Landed(crc));
    }
    let Some(mut lease_end) = lock(receiver).lease_end(r).filter(|&end| Instant::now() < end) else {
        return Ok(InPlace::Stopped { left: at.remaining() });
    };
    let mut last_read = Instant::now();
    let timer = sleep_until(lease_end.min(last_read + idle));
    tokio::pin!(timer);
    while at.remaining() > 0 {
        let n = tokio::select! {
            biased;
            read = read_ready(socket, &at) => read.map_err(ReadError::Io)?,
            () = &mut timer => {
                let now = Instant::now();
                if now >= last_read + idle {
                    return Err(ReadError::Idle(idle));
                }
                match lock(receiver).lease_end(r).filter(|&end| now < end) {
                    Some(end) => lease_end = end,
                    None => return Ok(InPlace::Stopped { left: at.remaining() }),
                }
                timer.as_mut().reset(lease_end.min(last_read + idle));
                continue;
            }
        };
        if n == 0 {
            return Err(ReadError::Truncated);
        }
        last_read = Instant::now();
        // Checksummed as read, while still in cache, where the engine will read it.
        let mut left = n;
        while left > 0 {
            let (dst, room) = at.here();
            let k = room.min(left);
            // SAFETY: the kernel just wrote these `k` bytes of an open block.
            crc = unsafe { checksum::crc_raw(dst, k, crc) };
            at.advance(k);
            left -= k;
        }
    }
    Ok(InPlace::Landed(crc))
}

/// One `readv` of at most [`READ_CHUNK`] bytes at `at`, once the socket is readable.
async fn read_ready(socket: &TcpStream, at: &Cursor<'_>) -> io::Result<usize> {
    // Every piece is a block held open for this read (see `read_into_pool`).
    vectored(socket, at, READ_CHUNK, Way::Read).await
}

/// Which way a vectored system call moves bytes between a socket and a [`Cursor`]'s pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Way {
    /// `readv`: the kernel writes the pieces.
    Read,
    /// `writev`: the kernel reads them.
    Write,
}

/// One `readv` or `writev` of at most `max` bytes at `at`, once the socket is ready for
/// it. The callers keep the contract the system call needs: reading, every piece is
/// memory no Rust reference names and nothing else writes now (a block held open for a
/// direct read); writing, every piece is memory that stays mapped (the caller's header,
/// or pool memory whose mapping the caller holds).
pub(crate) async fn vectored(socket: &TcpStream, at: &Cursor<'_>, max: usize, way: Way) -> io::Result<usize> {
    let interest = match way {
        Way::Read => Interest::READABLE,
        Way::Write => Interest::WRITABLE,
    };
    loop {
        socket.ready(interest).await?;
        let fd = socket.as_raw_fd();
        let r = socket.try_io(interest, || {
            let iov = at.iovecs(max);
            let (ptr, n) = (iov.as_ptr(), iov.len() as libc::c_int);
            // SAFETY: the iovecs name the pieces the caller vouches for (above), at most
            // [`MAX_IOV`] of them, each within its piece; `fd` is the socket, open while
            // `socket` is borrowed.
            let done = unsafe {
                match way {
                    Way::Read => libc::readv(fd, ptr, n),
                    Way::Write => libc::writev(fd, ptr, n),
                }
            };
            if done < 0 {
                Err(io::Error::last_os_error())
            } else {
                Ok(done as usize)
            }
        });
        match r {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            r => return r,
        }
    }
}

/// A position in a payload's pieces.
pub(crate) struct Cursor<'a> {
    pieces: &'a [(usize, usize)],
    piece: usize,
    offset: usize,
}

impl<'a> Cursor<'a> {
    /// At the start of `pieces`.
    pub(crate) fn new(pieces: &'a [(usize, usize)]) -> Self {
        Self { pieces, piece: 0, offset: 0 }
    }

    /// Where the next byte goes and how many fit in its piece.
    fn here(&self) -> (*mut u8, usize) {
        let (at, len) = self.pieces[self.piece];
        ((at + self.offset) as *mut u8, len - self.offset)
    }

    pub(crate) fn advance(&mut self, mut n: usize) {
        while n > 0 {
            let room = self.pieces[self.piece].1 - self.offset;
            if n < room {
                self.offset += n;
                return;
            }
            n -= room;
            self.piece += 1;
            self.offset = 0;
        }
    }

    pub(crate) fn remaining(&self) -> usize {
        match self.pieces.get(self.piece..) {
            Some(rest) if !rest.is_empty() => rest.iter().map(|p| p.1).sum::<usize>() - self.offset,
            _ => 0,
        }
    }

    /// The next at most `max` bytes, as at most [`MAX_IOV`] iovecs.
    pub(crate) fn iovecs(&self, max: usize) -> Vec<libc::iovec> {
        let mut out = Vec::new();
        let (mut piece, mut offset, mut left) = (self.piece, self.offset, max);
        while piece < self.pieces.len() && left > 0 && out.len() < MAX_IOV {
            let (at, len) = self.pieces[piece];
            let n = (len - offset).min(left);
            out.push(libc::iovec { iov_base: (at + offset) as *mut libc::c_void, iov_len: n });
            left -= n;
            (piece, offset) = (piece + 1, 0);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use types::kv::KvDtype;

    const LAYOUT: KvLayout = KvLayout { n_layers: 2, n_kv_heads: 1, head_dim: 8, block_size: 4, dtype: KvDtype::F16 };

    #[test]
    fn pieces_follow_the_pool_formula_and_merge_adjacent_blocks() {
        let mem = PoolMemory::new(LAYOUT, 10).expect("map");
        let pool = mem.direct();
        let side = LAYOUT.side_bytes();
        let base = pool.addr;
        let at = |layer, v, b| base + LAYOUT.pool_offset(10, layer, v, b);
        let pieces = pool.pieces(1, &[3, 4, 7]).expect("in the pool");
        assert_eq!(
            pieces,
            vec![
                (at(1, false, 3), 2 * side),
                (at(1, false, 7), side),
                (at(1, true, 3), 2 * side),
                (at(1, true, 7), side)
            ]
        );
        assert_eq!(pool.pieces(1, &[3, 10]), None, "block 10 is outside a pool of 10");
        assert_eq!(pool.pieces(2, &[3]), None, "layer 2 of 2");
        // The last block of the last layer's V ends where the pool does.
        let last = pool.pieces(1, &[9]).expect("in the pool");
        assert_eq!(last[1].0 + last[1].1, base + LAYOUT.pool_bytes(10).expect("size"));
    }

    /// The pool's mapping asks for huge pages wherever the kernel can give them
    /// (THP not `never`: the mapping carries the `hg` flag), and is backed
    /// before any transfer (resident at once).
    #[test]
    fn the_pool_asks_for_huge_pages_and_is_resident_at_once() {
        let mem = PoolMemory::new(LAYOUT, 4096).expect("map");
        let pool = mem.direct();
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        // The mapping holding the pool: the kernel may have merged it with a neighbour.
        let holds = |l: &str| {
            let range = l.split_whitespace().next().and_then(|r| r.split_once('-'));
            let parse = |h: &str| usize::from_str_radix(h, 16).ok();
            range.and_then(|(a, b)| Some((parse(a)?, parse(b)?))).is_some_and(|(a, b)| a <= pool.addr && pool.addr < b)
        };
        let mut lines = smaps.lines().skip_while(|l| !holds(l));
        let header = lines.next().unwrap_or_else(|| panic!("no mapping holds {:#x}", pool.addr));
        // The mapping's fields, up to the next mapping's header line.
        let entry: Vec<&str> =
            lines.take_while(|l| l.split_whitespace().next().is_some_and(|k| k.ends_with(':'))).collect();
        let field = |name: &str| entry.iter().find_map(|l| l.strip_prefix(name)).map(str::trim);
        let rss_kib: usize = field("Rss:")
            .and_then(|v| v.trim_end_matches("kB").trim().parse().ok())
            .unwrap_or_else(|| panic!("no Rss for {header}: {entry:?}"));
        let len = LAYOUT.pool_bytes(4096).expect("size");
        assert!(rss_kib * 1024 >= len, "resident before any transfer: {header}: {entry:?}");
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if !thp.is_empty() && !thp.contains("[never]") {
            let flags = field("VmFlags:").unwrap_or_else(|| panic!("no VmFlags for {header}"));
            assert!(flags.split_whitespace().any(|f| f == "hg"), "MADV_HUGEPAGE not taken: {flags}");
        }
    }

    #[test]
    fn a_cursor_walks_pieces_byte_by_byte_and_in_bounded_iovecs() {
        let pieces = [(1000, 10), (5000, 3), (9000, 7)];
        let mut c = Cursor { pieces: &pieces, piece: 0, offset: 0 };
        assert_eq!(c.remaining(), 20);
        let iov = c.iovecs(12);
        assert_eq!(
            iov.iter().map(|v| (v.iov_base as usize, v.iov_len)).collect::<Vec<_>>(),
            vec![(1000, 10), (5000, 2)]
        );
        c.advance(11);
        assert_eq!((c.here().0 as usize, c.here().1, c.remaining()), (5001, 2, 9));
        c.advance(2);
        assert_eq!((c.here().0 as usize, c.remaining()), (9000, 7));
        c.advance(7);
        assert_eq!(c.remaining(), 0);
        assert!(c.iovecs(100).is_empty());
    }
}
