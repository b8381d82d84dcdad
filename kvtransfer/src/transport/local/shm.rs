//! The shared-memory ring: a sealed memfd of `slots` slots, mapped
//! read-write by the sender and read-only by the receiver. The only
//! `unsafe` code of the local transport: writing into the sender's mapping
//! and copying out of the receiver's (with [`copy_crc`], which computes the
//! CRC-32C on the words it moves).
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
use crate::checksum::copy_crc;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::STREAM;

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
    fn the_copy_out_checksums_exactly_what_it_copied() {
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
